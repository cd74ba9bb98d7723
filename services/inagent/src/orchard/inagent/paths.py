"""Path checks and display: what the agent accepts as a path, and how it shows one it found.

Requests carry paths as protobuf strings (UTF-8); the agent works on bytes internally so that
names which are not UTF-8 survive exactly. Such names are shown with ``\\xNN`` escapes, and
``FileInfo.raw_path`` then carries the exact bytes.
"""

from __future__ import annotations

import os

from orchard.core.errors import OrchardError, Reason

__all__ = ["NAME_MAX", "PATH_MAX", "check_path", "display", "resolve"]

PATH_MAX = 4096
"""Linux's limit on a path, in bytes, including the terminating NUL."""
NAME_MAX = 255
"""Linux's limit on one path component, in bytes."""


def check_path(path: str, field: str = "path") -> bytes:
    """Return ``path`` as bytes, or raise INVALID_ARGUMENT (reason INVALID_PATH) saying why not.

    Refused: empty, a NUL byte, PATH_MAX bytes or more, a component longer than NAME_MAX bytes.
    """
    if not path:
        raise _invalid(field, f"{field} is empty")
    raw = path.encode("utf-8", "surrogateescape")
    nul = raw.find(b"\0")
    if nul >= 0:
        raise _invalid(field, f"{field} contains a NUL byte at offset {nul}")
    if len(raw) >= PATH_MAX:
        raise _invalid(
            field, f"{field} is {len(raw)} bytes long; the limit is {PATH_MAX - 1} (PATH_MAX)"
        )
    for component in raw.split(b"/"):
        if len(component) > NAME_MAX:
            shown = display(component[:40])[0]
            raise _invalid(
                field,
                f"{field} has a component of {len(component)} bytes ({shown}...); "
                f"the limit is {NAME_MAX} (NAME_MAX)",
            )
    return raw


def resolve(raw: bytes, working_dir: bytes) -> bytes:
    """An absolute, lexically normalized form of ``raw``; relative paths join ``working_dir``."""
    return os.path.normpath(os.path.join(working_dir, raw))


def display(raw: bytes) -> tuple[str, bytes]:
    """``raw`` as text with ``\\xNN`` for bytes that are not UTF-8, and the raw bytes when needed.

    The second item is empty when ``raw`` is valid UTF-8 (the text then says it exactly).
    """
    try:
        return raw.decode("utf-8"), b""
    except UnicodeDecodeError:
        return raw.decode("utf-8", "backslashreplace"), raw


def _invalid(field: str, message: str) -> OrchardError:
    return OrchardError(Reason.INVALID_PATH, message, metadata={"field": field})
