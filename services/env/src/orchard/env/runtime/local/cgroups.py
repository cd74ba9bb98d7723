"""One cgroup per sandbox, with cpu, memory and pids limits: cgroup v2 where the host delegates
those controllers to the unified tree, else the v1 hierarchies.

Layout: ``<parent>/<sandbox id>`` in each hierarchy used (v1: cpu, memory and pids, and the
freezer where it is mounted, which may share a directory when co-mounted; v2: one directory).
A relative parent lies below the service's own cgroup, so sandboxes stay inside whatever limits
the service itself runs under.

Freezing (``freeze``/``thaw``: v1 ``freezer.state``, v2 ``cgroup.freeze``) stops every task of a
sandbox at once, so that a fork copies a file system nobody writes to meanwhile.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import errno
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from orchard.env.runtime.base import RuntimeResources, RuntimeUnavailable

__all__ = ["CgroupDriver", "CgroupV1", "CgroupV2", "FreezeFailed", "select_cgroup_driver"]

CONTROLLERS = ("cpu", "memory", "pids")
FREEZER = "freezer"  # v1 only, and optional: without it a v1 sandbox cannot be frozen
CFS_PERIOD_US = 100_000
FREEZE_TIMEOUT_S = 5.0
_FREEZE_POLL_S = 0.001


class FreezeFailed(Exception):
    """A sandbox's cgroup did not reach the frozen state in time (it was thawed again)."""


@dataclass(frozen=True)
class _Mount:
    point: str
    fstype: str
    options: frozenset[str]


def _mounts(mountinfo: str = "/proc/self/mountinfo") -> list[_Mount]:
    found = []
    with open(mountinfo, encoding="utf-8") as file:
        for line in file:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
                continue
            point = fields[4].replace("\\040", " ")
            found.append(_Mount(point, tail[0], frozenset(tail[2].split(","))))
    return found


def _own_cgroups(path: str = "/proc/self/cgroup") -> dict[str, str]:
    """Controller (or ``""`` for v2) → this process's cgroup path in that hierarchy."""
    own: dict[str, str] = {}
    with open(path, encoding="utf-8") as file:
        for line in file:
            _, controllers, where = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                own[name] = where
    return own


def _join(mount_point: str, own: str, parent: str) -> str:
    base = parent if parent.startswith("/") else f"{own.rstrip('/')}/{parent}"
    return os.path.normpath(f"{mount_point}/{base.lstrip('/')}")


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as file:
        file.write(value)


def _read(path: str) -> str:
    with open(path, encoding="ascii") as file:
        return file.read()


def _counter(path: str, key: str) -> int:
    try:
        for line in _read(path).splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (FileNotFoundError, ValueError):
        pass
    return 0


class CgroupDriver(abc.ABC):
    """The cgroups of every sandbox in one cgroup version."""

    version: str

    def __init__(self, parents: tuple[str, ...]) -> None:
        self.parents = parents  # one directory per hierarchy used

    @abc.abstractmethod
    def prepare(self) -> None:
        """Create the parent(s); raise :class:`RuntimeUnavailable` when they are unusable."""

    def dirs_for(self, sandbox_id: str) -> tuple[str, ...]:
        return tuple(f"{parent}/{sandbox_id}" for parent in self.parents)

    def create(self, sandbox_id: str, resources: RuntimeResources) -> tuple[str, ...]:
        """Make the sandbox's cgroup(s) with ``resources``; returns their directories."""
        dirs = self.dirs_for(sandbox_id)
        for directory in dirs:
            os.mkdir(directory)
        self._limit(dirs, resources)
        return dirs

    @abc.abstractmethod
    def _limit(self, dirs: tuple[str, ...], resources: RuntimeResources) -> None: ...

    @staticmethod
    def procs_files(dirs: tuple[str, ...]) -> list[str]:
        """Files a process writes its pid to, to join the sandbox's cgroup(s)."""
        return [f"{directory}/cgroup.procs" for directory in dirs]

    def move(self, pid: int, dirs: tuple[str, ...]) -> None:
        """Move the process ``pid`` (alone: a single-threaded process) into ``dirs``."""
        for path in self.procs_files(dirs):
            _write(path, str(pid))

    def take_over(
        self, old_dirs: tuple[str, ...], pid: int, sandbox_id: str, resources: RuntimeResources
    ) -> tuple[str, ...]:
        """Give the cgroup(s) ``old_dirs``, whose only task is ``pid``, to ``sandbox_id`` with
        ``resources``; returns the new directories.

        Renamed where the hierarchy allows it (v1): moving a task between v1 cgroups waits for
        an RCU grace period per hierarchy (about 2 ms each). Elsewhere (v2 has no rename) the
        task moves into new cgroups and the old ones go.
        """
        dirs = self.dirs_for(sandbox_id)
        try:
            for old, new in zip(old_dirs, dirs, strict=True):
                os.rename(old, new)
        except (OSError, ValueError):
            for old, new in zip(old_dirs, dirs, strict=False):
                with contextlib.suppress(OSError):
                    os.rename(new, old)  # back, so that the fallback starts from one layout
            self.create(sandbox_id, resources)
            self.move(pid, dirs)
            self.remove(old_dirs)
            return dirs
        self._limit(dirs, resources)
        return dirs

    @abc.abstractmethod
    def can_freeze(self, dirs: tuple[str, ...]) -> bool:
        """Whether :meth:`freeze` can stop the tasks of these cgroup(s)."""

    @abc.abstractmethod
    def _request_freeze(self, dirs: tuple[str, ...], frozen: bool) -> None: ...

    @abc.abstractmethod
    def is_frozen(self, dirs: tuple[str, ...]) -> bool:
        """Whether every task in the cgroup(s) is stopped by the freezer."""

    async def freeze(self, dirs: tuple[str, ...], timeout_s: float = FREEZE_TIMEOUT_S) -> None:
        """Stop every task in the cgroup(s) and return once all are stopped.

        Raises :class:`FreezeFailed` (the cgroup thawed again) when that takes longer than
        ``timeout_s``, e.g. a task stuck in the kernel."""
        self._request_freeze(dirs, True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.is_frozen(dirs):
            if loop.time() > deadline:
                self.thaw(dirs)
                raise FreezeFailed(f"{', '.join(dirs)} did not freeze within {timeout_s:g} s")
            # The kernel stops tasks as they reach a safe point: usually well under a millisecond.
            await asyncio.sleep(_FREEZE_POLL_S)

    def thaw(self, dirs: tuple[str, ...]) -> None:
        """Let the cgroup's tasks run again (no-op when not frozen, or gone)."""
        if self.can_freeze(dirs):
            with contextlib.suppress(FileNotFoundError):
                self._request_freeze(dirs, False)

    @abc.abstractmethod
    def oom_kills(self, dirs: tuple[str, ...]) -> int:
        """How many processes the OOM killer killed in the sandbox's cgroup so far."""

    def ids(self) -> set[str]:
        """Every sandbox that has a cgroup here."""
        found: set[str] = set()
        for parent in self.parents:
            with contextlib.suppress(FileNotFoundError):
                found.update(e.name for e in os.scandir(parent) if e.is_dir())
        return found

    @staticmethod
    def tasks(dirs: tuple[str, ...]) -> set[int]:
        pids: set[int] = set()
        for directory in dirs:
            with contextlib.suppress(FileNotFoundError):
                pids.update(int(line) for line in _read(f"{directory}/cgroup.procs").split())
        return pids

    def kill_tasks(self, dirs: tuple[str, ...]) -> int:
        """SIGKILL every process in the cgroup(s); returns how many were signalled."""
        self.thaw(dirs)  # a v1 frozen task dies only once thawed
        pids = self.tasks(dirs)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    @staticmethod
    def remove(dirs: tuple[str, ...]) -> bool:
        """Remove the directories; False while a task is still in one (EBUSY)."""
        for directory in dirs:
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    return False
                raise
        return True


class CgroupV1(CgroupDriver):
    """The cpu, memory and pids v1 hierarchies (this build machine's case)."""

    version = "v1"

    def __init__(self, parents: tuple[str, ...], by_controller: dict[str, str]) -> None:
        super().__init__(parents)
        self.by_controller = by_controller  # controller → parent directory

    @classmethod
    def discover(cls, parent: str) -> CgroupV1:
        mounts = [m for m in _mounts() if m.fstype == "cgroup"]
        own = _own_cgroups()
        by_controller: dict[str, str] = {}
        for controller in CONTROLLERS:
            mount = next((m for m in mounts if controller in m.options), None)
            if mount is None:
                raise RuntimeUnavailable(
                    f"cgroup v1: the {controller} controller is not mounted (looked in "
                    "/proc/self/mountinfo); mount it, e.g. `mount -t cgroup -o "
                    f"{controller} cgroup /sys/fs/cgroup/{controller}`, or use cgroup v2"
                )
            by_controller[controller] = _join(mount.point, own.get(controller, "/"), parent)
        # Last, so that the others keep their places in the cgroup_dirs of older state files.
        freezer = next((m for m in mounts if FREEZER in m.options), None)
        if freezer is not None:
            by_controller[FREEZER] = _join(freezer.point, own.get(FREEZER, "/"), parent)
        parents = tuple(dict.fromkeys(by_controller.values()))
        return cls(parents, by_controller)

    def prepare(self) -> None:
        for directory in self.parents:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as exc:
                raise RuntimeUnavailable(f"cgroup v1: cannot create {directory}: {exc}") from exc

    def _dir(self, dirs: tuple[str, ...], controller: str) -> str:
        return dirs[self.parents.index(self.by_controller[controller])]

    def _limit(self, dirs: tuple[str, ...], resources: RuntimeResources) -> None:
        memory = self._dir(dirs, "memory")
        if resources.memory_bytes:
            limit, memsw = str(resources.memory_bytes), f"{memory}/memory.memsw.limit_in_bytes"
            try:
                _write(f"{memory}/memory.limit_in_bytes", limit)
            except OSError:
                # Raising a taken-over cgroup's limit above its memory+swap limit: that first.
                _write(memsw, limit)
                _write(f"{memory}/memory.limit_in_bytes", limit)
            # Without this, swap would let the sandbox exceed the limit (absent: no swap
            # accounting on this kernel, nothing to close).
            with contextlib.suppress(FileNotFoundError, PermissionError):
                _write(memsw, limit)
        _write(f"{self._dir(dirs, 'pids')}/pids.max", str(resources.pids or "max"))
        if resources.cpu_millis:
            cpu = self._dir(dirs, "cpu")
            _write(f"{cpu}/cpu.cfs_period_us", str(CFS_PERIOD_US))
            _write(f"{cpu}/cpu.cfs_quota_us", str(resources.cpu_millis * CFS_PERIOD_US // 1000))

    def oom_kills(self, dirs: tuple[str, ...]) -> int:
        return _counter(f"{self._dir(dirs, 'memory')}/memory.oom_control", "oom_kill")

    def _freezer_dir(self, dirs: tuple[str, ...]) -> str | None:
        # By prefix, not position: a sandbox started before the freezer was used lacks one.
        parent = self.by_controller.get(FREEZER)
        if parent is None:
            return None
        return next((d for d in dirs if os.path.dirname(d) == parent), None)

    def can_freeze(self, dirs: tuple[str, ...]) -> bool:
        return self._freezer_dir(dirs) is not None

    def _request_freeze(self, dirs: tuple[str, ...], frozen: bool) -> None:
        directory = self._freezer_dir(dirs)
        if directory is None:
            raise FreezeFailed(f"no v1 freezer cgroup among {', '.join(dirs)}")
        _write(f"{directory}/freezer.state", "FROZEN" if frozen else "THAWED")

    def is_frozen(self, dirs: tuple[str, ...]) -> bool:
        directory = self._freezer_dir(dirs)
        return directory is not None and _read(f"{directory}/freezer.state").strip() == "FROZEN"


class CgroupV2(CgroupDriver):
    """The unified hierarchy, where the host delegates cpu, memory and pids."""

    version = "v2"

    @classmethod
    def discover(cls, parent: str) -> CgroupV2:
        mount = next((m for m in _mounts() if m.fstype == "cgroup2"), None)
        if mount is None:
            raise RuntimeUnavailable("cgroup v2 is not mounted")
        return cls((_join(mount.point, _own_cgroups().get("", "/"), parent),))

    def _mount_point(self) -> str:
        parent = self.parents[0]
        mounts = [m.point for m in _mounts() if m.fstype == "cgroup2"]
        return max((m for m in mounts if parent.startswith(m)), key=len)

    def prepare(self) -> None:
        parent = Path(self.parents[0])
        root = Path(self._mount_point())
        chain = [parent, *(p for p in parent.parents if p != root and root in p.parents)]
        chain.append(root)
        chain.reverse()  # root first
        wanted = " ".join(f"+{c}" for c in CONTROLLERS)
        for directory in chain:
            if not directory.exists():
                try:
                    directory.mkdir()
                except OSError as exc:
                    raise RuntimeUnavailable(
                        f"cgroup v2: cannot create {directory}: {exc}"
                    ) from exc
            available = set(_read(f"{directory}/cgroup.controllers").split())
            missing = set(CONTROLLERS) - available
            if missing:
                raise RuntimeUnavailable(
                    f"cgroup v2: {directory} lacks the {', '.join(sorted(missing))} "
                    "controller(s); delegate them (systemd: Delegate=yes) or use cgroup v1"
                )
            enabled = set(_read(f"{directory}/cgroup.subtree_control").split())
            if set(CONTROLLERS) <= enabled:
                continue
            try:
                _write(f"{directory}/cgroup.subtree_control", wanted)
            except OSError as exc:
                raise RuntimeUnavailable(
                    f"cgroup v2: cannot enable {wanted} in {directory}/cgroup.subtree_control "
                    f"({exc}); a cgroup with processes cannot delegate controllers: run the "
                    "service in a leaf cgroup and point cgroup_parent at a sibling (absolute)"
                ) from exc

    def _limit(self, dirs: tuple[str, ...], resources: RuntimeResources) -> None:
        (directory,) = dirs
        if resources.memory_bytes:
            _write(f"{directory}/memory.max", str(resources.memory_bytes))
            with contextlib.suppress(FileNotFoundError):
                _write(f"{directory}/memory.swap.max", "0")
        _write(f"{directory}/pids.max", str(resources.pids or "max"))
        if resources.cpu_millis:
            quota = resources.cpu_millis * CFS_PERIOD_US // 1000
            _write(f"{directory}/cpu.max", f"{quota} {CFS_PERIOD_US}")

    def oom_kills(self, dirs: tuple[str, ...]) -> int:
        return _counter(f"{dirs[0]}/memory.events", "oom_kill")

    def can_freeze(self, dirs: tuple[str, ...]) -> bool:
        return bool(dirs) and os.path.exists(f"{dirs[0]}/cgroup.freeze")  # Linux 5.2+

    def _request_freeze(self, dirs: tuple[str, ...], frozen: bool) -> None:
        _write(f"{dirs[0]}/cgroup.freeze", "1" if frozen else "0")

    def is_frozen(self, dirs: tuple[str, ...]) -> bool:
        # cgroup.freeze is what was asked; cgroup.events says when every task has stopped.
        return _counter(f"{dirs[0]}/cgroup.events", "frozen") == 1

    def kill_tasks(self, dirs: tuple[str, ...]) -> int:
        count = len(self.tasks(dirs))
        try:
            _write(f"{dirs[0]}/cgroup.kill", "1")  # Linux 5.14+: atomic, forks cannot escape
        except FileNotFoundError:
            return super().kill_tasks(dirs)
        return count


def _v2_usable(parent: str) -> bool:
    try:
        driver = CgroupV2.discover(parent)
    except (RuntimeUnavailable, OSError):
        return False
    directory = Path(driver.parents[0])
    while not directory.exists():
        directory = directory.parent
    try:
        available = set(_read(f"{directory}/cgroup.controllers").split())
    except OSError:
        return False
    return set(CONTROLLERS) <= available


def select_cgroup_driver(parent: str, version: str) -> CgroupDriver:
    """The driver for ``version`` (``auto``: v2 when its controllers are delegated, else v1)."""
    if version == "v2" or (version == "auto" and _v2_usable(parent)):
        return CgroupV2.discover(parent)
    return CgroupV1.discover(parent)
