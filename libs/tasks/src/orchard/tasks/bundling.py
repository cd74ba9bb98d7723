"""Python distributions of this environment, copied for a sandbox whose image lacks them.

A sandbox runs its image's ``python3``; a tool server there (the Claw MCP server, the GUI
browser server) needs packages the image may not have. They are taken from the installed
distributions of this environment with everything they require, so what runs in the sandbox is
what the tests ran against, offline. Compiled extensions tie the copy to this Python's minor
version: the launchers refuse another one, saying so.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path

__all__ = ["PYTHON_VERSION", "distribution_files", "requirement_closure"]

PYTHON_VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"


def requirement_closure(roots: Iterable[str], *, install_hint: str) -> list[metadata.Distribution]:
    """The installed distributions ``roots`` need, themselves included, by name.

    Raises RuntimeError naming ``install_hint`` when one is not installed."""
    # packaging is imported only when bundling (it comes with the extras that bundle).
    from packaging.requirements import Requirement  # noqa: PLC0415
    from packaging.utils import canonicalize_name  # noqa: PLC0415

    seen: dict[str, metadata.Distribution] = {}
    todo: list[tuple[str, frozenset[str]]] = [(root, frozenset()) for root in roots]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen:
            continue
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise RuntimeError(
                f"{name} is not installed in this environment: install {install_hint}"
            ) from None
        seen[key] = distribution
        for line in distribution.requires or []:
            requirement = Requirement(line)
            wanted = extras or frozenset({""})
            marker = requirement.marker
            if marker is not None and not any(marker.evaluate({"extra": e}) for e in wanted):
                continue
            todo.append((requirement.name, frozenset(requirement.extras)))
    return sorted(seen.values(), key=lambda d: str(d.metadata["Name"]).lower())


def distribution_files(
    distributions: Iterable[metadata.Distribution],
) -> Iterator[tuple[str, Path, int]]:
    """(path relative to a site folder, the installed file, its mode) of every file the
    distributions installed there; bytecode and files outside the site folder left out.
    Executables keep their bit (Playwright's driver is a program)."""
    for distribution in distributions:
        for file in distribution.files or []:
            if file.suffix == ".pyc" or "__pycache__" in file.parts or file.parts[0] == "..":
                continue
            path = Path(str(distribution.locate_file(file)))
            if path.is_file():
                yield str(file), path, 0o755 if path.stat().st_mode & 0o111 else 0o644
