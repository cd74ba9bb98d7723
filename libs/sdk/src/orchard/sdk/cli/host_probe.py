"""What ``orchard bench env`` reads from this host: proportional memory of processes, the
cgroups of sandboxes, CPU time, MemAvailable, and what a run left behind.

Memory is PSS (proportional set size): the ``Pss:`` line of ``/proc/PID/smaps_rollup``, so
pages shared by many sandboxes (the agent bundle, the host's libraries) count once in total,
split among the processes that map them. Linux only; every reader returns 0 or nothing where
the file is missing (a process that just exited).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MEMORY_FRACTION",
    "MEMORY_METHOD",
    "ConcurrencyPlan",
    "SandboxCgroups",
    "cpu_seconds",
    "mem_available_bytes",
    "plan_concurrency",
    "process_running",
    "process_start_time",
    "pss_bytes",
]

MEMORY_METHOD = (
    "sum of Pss from /proc/PID/smaps_rollup over the environment service, etcd and every "
    "process in the sandboxes' cgroups"
)
MEMORY_FRACTION = 0.7
"""Share of MemAvailable a run may plan to use before its concurrency is capped."""

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def pss_bytes(pid: int, proc: str = "/proc") -> int:
    """The process's PSS in bytes (0 when it is gone or unreadable)."""
    try:
        with open(f"{proc}/{pid}/smaps_rollup", encoding="ascii") as file:
            for line in file:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _stat_fields(pid: int, proc: str = "/proc") -> list[str]:
    try:
        with open(f"{proc}/{pid}/stat", encoding="ascii", errors="replace") as file:
            text = file.read()
    except OSError:
        return []
    # The command name may hold spaces and parentheses; fields start after the last ")".
    return text[text.rfind(")") + 2 :].split()


def cpu_seconds(pid: int, *, children: bool = False, proc: str = "/proc") -> float:
    """User + system CPU seconds of the process (with ``children``: of its reaped children)."""
    fields = _stat_fields(pid, proc)
    if len(fields) < 15:
        return 0.0
    first = 13 if children else 11  # cutime, cstime / utime, stime (0-based after the name)
    return (int(fields[first]) + int(fields[first + 1])) / _CLOCK_TICKS


def process_start_time(pid: int, proc: str = "/proc") -> int:
    """Start time in clock ticks after boot (0 when gone): with the pid, names one process."""
    fields = _stat_fields(pid, proc)
    return int(fields[19]) if len(fields) > 19 else 0


def process_running(pid: int, start_time: int, proc: str = "/proc") -> bool:
    """Whether the process that started at ``start_time`` still runs (a zombie, which holds
    nothing but its exit status until its parent reaps it, does not count)."""
    fields = _stat_fields(pid, proc)
    if len(fields) <= 19 or int(fields[19]) != start_time:
        return False
    return fields[0] not in ("Z", "X")


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable from ``meminfo`` in bytes."""
    with open(meminfo, encoding="ascii") as file:
        for line in file:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no MemAvailable line in {meminfo}")


@dataclass(frozen=True)
class ConcurrencyPlan:
    """How many sandboxes a run keeps in flight, and why."""

    requested: int
    concurrency: int
    capped_by_memory: bool
    memory_per_sandbox_bytes: int
    mem_available_bytes: int
    fraction: float = MEMORY_FRACTION

    def explain(self) -> str:
        if not self.capped_by_memory:
            return ""
        return (
            f"concurrency capped at {self.concurrency} (asked {self.requested}): "
            f"{self.requested} sandboxes x {self.memory_per_sandbox_bytes / 2**20:.1f} MiB "
            f"would exceed {self.fraction:.0%} of MemAvailable "
            f"({self.mem_available_bytes / 2**20:.0f} MiB)"
        )


def plan_concurrency(
    requested: int,
    memory_per_sandbox_bytes: int,
    mem_available: int,
    fraction: float = MEMORY_FRACTION,
) -> ConcurrencyPlan:
    """Cap ``requested`` so that that many sandboxes at once fit in ``fraction`` of
    ``mem_available``; at least 1."""
    budget = int(mem_available * fraction)
    per = max(1, memory_per_sandbox_bytes)
    fits = max(1, budget // per)
    concurrency = min(requested, fits)
    return ConcurrencyPlan(
        requested=requested,
        concurrency=concurrency,
        capped_by_memory=concurrency < requested,
        memory_per_sandbox_bytes=memory_per_sandbox_bytes,
        mem_available_bytes=mem_available,
        fraction=fraction,
    )


def _cgroup_roots(mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Mount points of the cgroup hierarchies that hold process lists (pids or v2 first)."""
    v1: list[tuple[int, str]] = []
    v2: list[str] = []
    with open(mountinfo, encoding="utf-8") as file:
        for line in file:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(rest) < 3:
                continue
            point = fields[4].replace("\\040", " ")
            if rest[0] == "cgroup2":
                v2.append(point)
            elif rest[0] == "cgroup":
                options = set(rest[2].split(","))
                # pids and memory are the hierarchies the local runtime always uses.
                v1.append((0 if "pids" in options else 1 if "memory" in options else 2, point))
    return [point for _, point in sorted(v1)] + v2


class SandboxCgroups:
    """Finds the cgroup directories of sandboxes by their ids (a runtime names each sandbox's
    cgroup after it), in whichever hierarchy holds them, without knowing the service's config.
    """

    def __init__(self, roots: Iterable[str] | None = None, max_depth: int = 8) -> None:
        self.roots = list(roots) if roots is not None else _cgroup_roots()
        self.max_depth = max_depth
        self.parents: list[str] = []  # directories that hold sandbox cgroups, once found

    def locate(self, sandbox_id: str) -> bool:
        """Search the hierarchies for ``sandbox_id``'s directory; remember its parents."""
        found: list[str] = []
        for root in self.roots:
            base_depth = root.rstrip("/").count("/")
            for directory, subdirs, _ in os.walk(root):
                if directory.count("/") - base_depth >= self.max_depth:
                    subdirs.clear()
                    continue
                if sandbox_id in subdirs:
                    found.append(directory)
                    subdirs.clear()
        self.parents = list(dict.fromkeys(found))
        return bool(self.parents)

    def dirs(self, sandbox_id: str) -> list[str]:
        return [
            f"{parent}/{sandbox_id}"
            for parent in self.parents
            if os.path.isdir(f"{parent}/{sandbox_id}")
        ]

    def pids(self, sandbox_ids: Iterable[str]) -> dict[str, set[int]]:
        """Sandbox id → pids in its cgroup(s), for those that still have one."""
        found: dict[str, set[int]] = {}
        for sandbox_id in sandbox_ids:
            pids: set[int] = set()
            for directory in self.dirs(sandbox_id):
                with contextlib.suppress(OSError, ValueError):
                    pids.update(
                        int(p) for p in Path(f"{directory}/cgroup.procs").read_text().split()
                    )
            if pids:
                found[sandbox_id] = pids
        return found


def mounts_naming(names: Iterable[str], mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Mount points of this mount namespace whose line names one of ``names``."""
    wanted = set(names)
    if not wanted:
        return []
    found = []
    with open(mountinfo, encoding="utf-8") as file:
        for line in file:
            if any(name in line for name in wanted):
                found.append(line.split()[4])
    return found


def remove_cgroup_parent(name: str) -> None:
    """rmdir a private cgroup parent in every hierarchy (empty after every delete; a busy one
    stays, so nothing running is ever cut off)."""
    finder = SandboxCgroups()
    if finder.locate(name):
        for parent in finder.parents:
            with contextlib.suppress(OSError):
                os.rmdir(f"{parent}/{name}")
