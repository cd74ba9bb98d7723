"""Fixtures of the security suite: the real service over the real ``local`` runtime, images an
attacker works from, host resources a sandbox must not reach, and the count of attacks tried
(printed in the terminal summary: `attacks tried N, held N`)."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# Attacks recorded by `attack.held(name)` in this run, in order; printed at the end.
ATTACKS_HELD: list[str] = []
ATTACKS_TRIED: list[str] = []
# Lines a test wants in the terminal summary whatever `-s` says (the fuzz target's numbers).
SUMMARY_LINES: list[str] = []


@dataclass
class AttackLog:
    """What one test tried: `tried(name)` before the attempt, `held(name)` once it is known to
    have failed as it must."""

    test: str
    names: list[str] = field(default_factory=list)

    def tried(self, name: str) -> None:
        self.names.append(name)
        ATTACKS_TRIED.append(f"{self.test}: {name}")

    def held(self, name: str) -> None:
        assert name in self.names, f"{name!r} was never tried"
        ATTACKS_HELD.append(f"{self.test}: {name}")


@pytest.fixture
def attack(request: pytest.FixtureRequest) -> AttackLog:
    return AttackLog(request.node.name)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not (ATTACKS_TRIED or SUMMARY_LINES):
        return
    terminalreporter.section("orchard security suite")
    if ATTACKS_TRIED:
        terminalreporter.write_line(f"attacks tried {len(ATTACKS_TRIED)}, held {len(ATTACKS_HELD)}")
        for name in sorted(set(ATTACKS_TRIED) - set(ATTACKS_HELD)):
            terminalreporter.write_line(f"  NOT HELD: {name}")
    for line in SUMMARY_LINES:
        terminalreporter.write_line(line)


@pytest.fixture
async def isolated(env_factory: Any, local_runtime: Any, busybox_root: Path) -> Any:
    """One replica of the service over the real ``local`` runtime: namespaces, cgroups,
    overlay roots, the real agent. Tenant ``alpha`` by default (``BETA_TOKEN`` for the other).
    As operator, it lets tenants use the ``host`` image and the busybox root."""
    from orchard.env.config import ImagesConfig

    images = ImagesConfig(allow_host=True, allowed_paths=[str(busybox_root.parent)])
    return await env_factory(runtime=local_runtime, images=images)


@pytest.fixture
def busybox_image(busybox_root: Path) -> str:
    """A root with nothing but a static busybox: nothing of the host's is in it."""
    return f"rootfs:{busybox_root}"


@dataclass
class HostSecret:
    """A file on the host, on a mount of its own, that no sandbox may see."""

    mount: Path
    file: Path
    content: bytes


@pytest.fixture
def host_secret(tmp_path: Path) -> Iterator[HostSecret]:
    """A tmpfs mounted on the host (so it is in no image's lower layer, not even the ``host``
    image's), holding a file with a random content; unmounted at the end."""
    mount = tmp_path / "host-only"
    mount.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "orchard-test", str(mount)], check=True
    )
    try:
        secret = HostSecret(mount, mount / "secret.txt", uuid.uuid4().hex.encode())
        secret.file.write_bytes(secret.content)
        yield secret
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.fixture
def host_sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A host process the sandboxes try to see and signal."""
    process = subprocess.Popen(["sleep", "300"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


@pytest.fixture
async def sandbox_cgroups(local_runtime: Any) -> AsyncIterator[Any]:
    """``dirs(sandbox_id)``: the sandbox's cgroup directories on the host, one per hierarchy."""

    def dirs(sandbox_id: str) -> list[Path]:
        parents = local_runtime._cgroups.parents
        return [Path(parent, sandbox_id) for parent in parents if os.path.isdir(parent)]

    yield dirs


@pytest.fixture
def summary() -> list[str]:
    """Lines for the terminal summary (shown with or without ``-s``)."""
    return SUMMARY_LINES
