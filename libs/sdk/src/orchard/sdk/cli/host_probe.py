"""What ``orchard bench env`` reads from this host: proportional memory of processes, the
cgroups of sandboxes, CPU time (per process, per cpuacct group, the whole host), MemAvailable,
and what a run left behind.

Memory is PSS (proportional set size): the ``Pss:`` line of ``/proc/PID/smaps_rollup``, so
pages shared by many sandboxes (the agent bundle, the host's libraries) count once in total,
split among the processes that map them. Linux only; every reader returns 0 or nothing where
the file is missing (a process that just exited).
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MEMORY_FRACTION",
    "MEMORY_METHOD",
    "ConcurrencyPlan",
    "CpuAccounting",
    "CpuTimes",
    "SandboxCgroups",
    "cpu_seconds",
    "host_cpu",
    "mem_available_bytes",
    "plan_concurrency",
    "process_cpu",
    "process_running",
    "process_start_time",
    "pss_bytes",
    "this_process_cpu",
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


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds in user mode and in the kernel (system)."""

    user: float = 0.0
    system: float = 0.0

    @property
    def total(self) -> float:
        return self.user + self.system

    def __add__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.user + other.user, self.system + other.system)

    def __sub__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.user - other.user, self.system - other.system)

    def per(self, count: int, scale: float = 1e3) -> dict[str, float]:
        """user, system and total per item, in milliseconds by default."""
        n = max(1, count)
        return {
            "user": round(self.user * scale / n, 3),
            "system": round(self.system * scale / n, 3),
            "total": round(self.total * scale / n, 3),
        }


def process_cpu(pid: int, *, children: bool = False, proc: str = "/proc") -> CpuTimes:
    """:func:`cpu_seconds` split into user and system (zero when the process is gone)."""
    fields = _stat_fields(pid, proc)
    if len(fields) < 15:
        return CpuTimes()
    first = 13 if children else 11
    return CpuTimes(int(fields[first]) / _CLOCK_TICKS, int(fields[first + 1]) / _CLOCK_TICKS)


def this_process_cpu(*, children: bool = False) -> CpuTimes:
    """This process's CPU (with ``children``: of its reaped children), from getrusage."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    return CpuTimes(usage.ru_utime, usage.ru_stime)


def host_cpu(stat: str = "/proc/stat") -> CpuTimes:
    """Busy CPU seconds of the whole host since boot: user (user, nice) and system (system,
    irq, softirq); every process on the machine, this benchmark's and others'."""
    with open(stat, encoding="ascii") as file:
        fields = [int(v) for v in file.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return CpuTimes((user + nice) / _CLOCK_TICKS, (system + irq + softirq) / _CLOCK_TICKS)


class CpuAccounting:
    """cgroup v1 ``cpuacct`` groups ``<mount>/<name>/<group>`` that processes are moved into,
    with every descendant they have then; processes they start later inherit the group.

    The local runtime moves its sandboxes into cpu, memory and pids groups, not cpuacct, so a
    service's group also counts every sandbox it starts (agents, commands, the kernel's work
    for them), also after the sandbox is gone. Unavailable (``available`` False) without a v1
    cpuacct hierarchy or without the right to write it.
    """

    def __init__(self, name: str, mountinfo: str = "/proc/self/mountinfo") -> None:
        self.root = _cpuacct_mount(mountinfo)
        self.base = f"{self.root}/{name}" if self.root else ""
        self.available = bool(self.root) and os.access(self.root, os.W_OK)
        self.groups: list[str] = []

    def add(self, group: str, pid: int) -> bool:
        """Move ``pid`` and its descendants into ``group``; False when that cannot be done."""
        if not self.available:
            return False
        directory = f"{self.base}/{group}"
        try:
            os.makedirs(directory, exist_ok=True)
            if group not in self.groups:
                self.groups.append(group)
            for member in [pid, *_descendants(pid)]:
                with (
                    contextlib.suppress(OSError),
                    open(f"{directory}/cgroup.procs", "w", encoding="ascii") as file,
                ):
                    file.write(str(member))
        except OSError:
            return False
        return True

    def read(self, group: str) -> CpuTimes | None:
        """CPU of everything that ran in ``group``: ``cpuacct.usage`` (ns) split into user and
        system by ``cpuacct.stat``; None when the group is missing."""
        directory = f"{self.base}/{group}"
        try:
            with open(f"{directory}/cpuacct.usage", encoding="ascii") as file:
                total = int(file.read()) / 1e9
            with open(f"{directory}/cpuacct.stat", encoding="ascii") as file:
                ticks = dict(line.split() for line in file if line.strip())
        except (OSError, ValueError):
            return None
        user, system = int(ticks.get("user", 0)), int(ticks.get("system", 0))
        share = user / (user + system) if user + system else 1.0
        return CpuTimes(total * share, total * (1 - share))

    def remove(self) -> None:
        """Move what is left to the root group and remove the groups (best effort)."""
        for group in reversed(self.groups):
            directory = f"{self.base}/{group}"
            with contextlib.suppress(OSError):
                with open(f"{directory}/cgroup.procs", encoding="ascii") as file:
                    left = file.read().split()
                for pid in left:
                    with (
                        contextlib.suppress(OSError),
                        open(f"{self.root}/cgroup.procs", "w", encoding="ascii") as root,
                    ):
                        root.write(pid)
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        if self.base:
            with contextlib.suppress(OSError):
                os.rmdir(self.base)
        self.groups.clear()


def _cpuacct_mount(mountinfo: str) -> str:
    with contextlib.suppress(OSError), open(mountinfo, encoding="utf-8") as file:
        for line in file:
            left, _, right = line.partition(" - ")
            rest = right.split()
            if len(rest) >= 3 and rest[0] == "cgroup" and "cpuacct" in rest[2].split(","):
                return left.split()[4].replace("\\040", " ")
    return ""


def _descendants(pid: int, proc: str = "/proc") -> list[int]:
    """Every process below ``pid`` now (from each process's parent in ``/proc/PID/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir(proc):
        if entry.isdigit():
            fields = _stat_fields(int(entry), proc)
            if len(fields) > 1:
                children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


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
