"""The figures of ``orchard bench env`` beside their floors, each measured in the same run.

- exec of a command (``true``): single round trip p50 (one call at a time), sustained execs/s
  at a chosen concurrency, p50 under a burst of concurrent calls, and the CPU per exec split by
  process (client, orchard-env, agents, the commands themselves; user and system time of each),
  beside ``subprocess.run`` of the same command measured the same way;
- create → READY of one sandbox at a time, beside a bare spawn in fresh pid, net, mount, uts and
  ipc namespaces (``unshare ... true``);
- fork of K sandboxes from one set up, beside K x (create + the same setup), the source's own
  create and setup counted once on the fork side.

The floors run interleaved with what they are compared to, so a loaded machine weighs on both.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchard.sdk.cli.host_probe import (
    CpuAccounting,
    CpuTimes,
    SandboxCgroups,
    process_cpu,
    this_process_cpu,
)

__all__ = [
    "UNSHARE_ARGV",
    "ExecSettings",
    "ProcessProfiler",
    "exec_figures",
    "fork_figures",
    "ready_figures",
]

UNSHARE_ARGV = ("unshare", "--pid", "--net", "--mount", "--uts", "--ipc", "--fork")
"""The namespaces of a local sandbox, around the command of the floor for create → READY."""
SETUP_COMMAND = (
    "sh",
    "-c",
    "mkdir -p repo && head -c 16777216 /dev/urandom | split -b 65536 - repo/part- "
    "&& sha256sum repo/part-* > repo.sha256",
)
"""The setup a fork copies, standing in for a task's preparation (a checkout and what is built
from it): a tree of 256 files of 64 KiB and their checksums (the same for fresh sandboxes)."""
SETUP_CHECK = ("sha256sum", "-c", "--quiet", "repo.sha256")
"""Each fork holds the source's tree, byte for byte."""
MIN_PROFILE_S = 1.0


@dataclass(frozen=True)
class ExecSettings:
    """What the exec figures run."""

    command: tuple[str, ...]
    sequential_calls: int = 300
    sustained_calls: int = 2000
    concurrency: int = 32
    burst: int = 1000


def _p(samples: Sequence[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] * 1e3, 3)


class _CpuProbe:
    """CPU of the processes that take part in an exec, read before and after a phase."""

    def __init__(
        self,
        service_pid: int | None,
        cgroups: SandboxCgroups,
        sandbox_ids: Sequence[str],
        accounting: CpuAccounting | None,
    ) -> None:
        self.service_pid = service_pid
        pids = cgroups.pids(sandbox_ids)
        self.agent_pids = sorted({pid for found in pids.values() for pid in found})
        self.accounting = accounting

    def snapshot(self) -> dict[str, CpuTimes]:
        taken = {
            "client": this_process_cpu(),
            "orchard_env": process_cpu(self.service_pid) if self.service_pid else CpuTimes(),
            "agents": sum((process_cpu(p) for p in self.agent_pids), CpuTimes()),
            # The agent is PID 1 of its sandbox and reaps its commands: their CPU is its
            # children's.
            "commands": sum((process_cpu(p, children=True) for p in self.agent_pids), CpuTimes()),
        }
        if self.accounting is not None:
            group = self.accounting.read("orchard-env")
            if group is not None:
                # A cross-check of orchard-env + agents + commands: its cpuacct group.
                taken["cgroup_env_and_sandboxes"] = group
        return taken


def _split(before: dict[str, CpuTimes], after: dict[str, CpuTimes], count: int) -> dict[str, Any]:
    per = {name: (after[name] - before[name]).per(count) for name in before}
    parts = ("client", "orchard_env", "agents", "commands")
    total = sum((after[n] - before[n] for n in parts if n in before), CpuTimes())
    per["all"] = total.per(count)
    return per


async def exec_figures(
    client: Any,
    sandboxes: Sequence[Any],
    settings: ExecSettings,
    *,
    service_pid: int | None,
    cgroups: SandboxCgroups,
    accounting: CpuAccounting | None = None,
    profiler: ProcessProfiler | None = None,
) -> dict[str, Any]:
    """Exec of ``settings.command`` through the service on ``sandboxes``, beside the floor."""
    command = list(settings.command)
    probe = _CpuProbe(service_pid, cgroups, [s.id for s in sandboxes], accounting)

    async def one(index: int) -> float:
        sandbox = sandboxes[index % len(sandboxes)]
        started = time.perf_counter()
        result = await sandbox.exec(command, timeout=60)
        if result.exit_code != 0:
            raise RuntimeError(f"{command} exited {result.exit_code} in {sandbox.id}")
        return time.perf_counter() - started

    if profiler is not None and probe.agent_pids:
        profiler.start("agent", probe.agent_pids[0])
    for index in range(min(50, settings.sequential_calls)):  # warm channels and agents
        await one(index)

    floor_sequential = await asyncio.to_thread(
        _subprocess_sequential, command, settings.sequential_calls
    )
    sequential = [await one(0) for _ in range(settings.sequential_calls)]

    floor_sustained = await asyncio.to_thread(
        _subprocess_sustained, command, settings.sustained_calls, settings.concurrency
    )
    before = probe.snapshot()
    began = time.perf_counter()
    sustained = await _concurrently(one, settings.sustained_calls, settings.concurrency)
    wall = time.perf_counter() - began
    after = probe.snapshot()
    if profiler is not None:
        profiler.stop("agent")

    began = time.perf_counter()
    burst = await asyncio.gather(*(one(i) for i in range(settings.burst)))
    burst_wall = time.perf_counter() - began
    return {
        "command": command,
        "sandboxes": len(sandboxes),
        "single_round_trip_p50_ms": _p(sequential, 50),
        "single_round_trip_p99_ms": _p(sequential, 99),
        "sustained": {
            "calls": settings.sustained_calls,
            "concurrency": settings.concurrency,
            "execs_per_second": round(settings.sustained_calls / wall, 1),
            "p50_ms": _p(sustained, 50),
            "cpu_ms_per_exec": _split(before, after, settings.sustained_calls),
        },
        "burst": {
            "calls": settings.burst,
            "p50_ms": _p(burst, 50),
            "p99_ms": _p(burst, 99),
            "wall_seconds": round(burst_wall, 3),
            "note": f"all at once over {len(sandboxes)} sandboxes, each runs one exec at a time",
        },
        "floor": {
            "method": "subprocess.run of the same command in this process, the sustained "
            "part from a pool of threads as large as the concurrency",
            "single_round_trip_p50_ms": _p(floor_sequential, 50),
            "execs_per_second": floor_sustained["execs_per_second"],
            "cpu_ms_per_exec": floor_sustained["cpu_ms_per_exec"],
        },
    }


async def _concurrently(
    one: Callable[[int], Awaitable[float]], calls: int, concurrency: int
) -> list[float]:
    latencies: list[float] = []
    next_index = iter(range(calls))

    async def worker() -> None:
        for index in next_index:
            latencies.append(await one(index))

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return latencies


def _subprocess_sequential(command: list[str], calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True)
        samples.append(time.perf_counter() - started)
    return samples


def _subprocess_sustained(command: list[str], calls: int, concurrency: int) -> dict[str, Any]:
    def run(_: int) -> None:
        subprocess.run(command, capture_output=True, check=True)

    before = (this_process_cpu(), this_process_cpu(children=True))
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        list(pool.map(run, range(calls)))
    wall = time.perf_counter() - began
    after = (this_process_cpu(), this_process_cpu(children=True))
    client, commands = after[0] - before[0], after[1] - before[1]
    return {
        "execs_per_second": round(calls / wall, 1),
        "cpu_ms_per_exec": {
            "client": client.per(calls),
            "commands": commands.per(calls),
            "all": (client + commands).per(calls),
        },
    }


async def ready_figures(
    create: Callable[[], Awaitable[Any]], delete: Callable[[Any], Awaitable[None]], repeats: int
) -> dict[str, Any]:
    """create → READY of one sandbox at a time, interleaved with the bare namespaced spawn."""
    unshare = shutil.which("unshare")
    ready: list[float] = []
    bare: list[float] = []
    floor_error = "" if unshare else "unshare not found on PATH"
    for _ in range(repeats):
        started = time.perf_counter()
        sandbox = await create()
        await sandbox.wait(timeout=120)
        ready.append(time.perf_counter() - started)
        await delete(sandbox)
        if unshare and not floor_error:
            started = time.perf_counter()
            done = await asyncio.to_thread(
                subprocess.run, [unshare, *UNSHARE_ARGV[1:], "true"], capture_output=True
            )
            if done.returncode != 0:
                floor_error = done.stderr.decode(errors="replace").strip()[:200]
            else:
                bare.append(time.perf_counter() - started)
    return {
        "repeats": repeats,
        "create_to_ready_p50_ms": _p(ready, 50),
        "create_to_ready_p99_ms": _p(ready, 99),
        "floor": {
            "method": " ".join([*UNSHARE_ARGV, "true"]),
            "p50_ms": _p(bare, 50),
            "error": floor_error,
        },
    }


async def fork_figures(
    client: Any,
    create: Callable[[], Awaitable[Any]],
    delete: Callable[[Any], Awaitable[None]],
    count: int,
    fork_labels: dict[str, str],
    *,
    track: Callable[[Any], None] = lambda sandbox: None,
) -> dict[str, Any]:
    """Fork ``count`` sandboxes from one set up vs ``count`` x (create + the same setup)."""
    from orchard.env.v1 import env_service_pb2  # noqa: PLC0415

    made: list[Any] = []

    async def fresh() -> Any:
        sandbox = await create()
        made.append(sandbox)
        await sandbox.wait(timeout=120)
        (await sandbox.exec(list(SETUP_COMMAND), timeout=60)).check()
        return sandbox

    try:
        started = time.perf_counter()
        source = await fresh()
        reply = await client.stub.ForkSandbox(
            env_service_pb2.ForkSandboxRequest(
                sandbox_id=source.id, count=count, labels=fork_labels
            ),
            metadata=client._metadata,
            timeout=120,
        )
        forks = [await client.get(info.id) for info in reply.sandboxes]
        for fork in forks:
            track(fork)
        made.extend(forks)
        await asyncio.gather(*(fork.wait(timeout=120) for fork in forks))
        fork_seconds = time.perf_counter() - started
        # Each fork holds the source's setup (checked outside the timing).
        for fork in forks:
            (await fork.exec(list(SETUP_CHECK), timeout=60)).check()

        # The baseline: count x (create + setup), one after another.
        started = time.perf_counter()
        for _ in range(count):
            await fresh()
        fresh_seconds = time.perf_counter() - started
        started = time.perf_counter()
        await asyncio.gather(*(fresh() for _ in range(count)))
        parallel_seconds = time.perf_counter() - started
    finally:
        await asyncio.gather(*(delete(s) for s in made), return_exceptions=True)
    return {
        "count": count,
        "setup": " ".join(SETUP_COMMAND),
        "fork_seconds": round(fork_seconds, 3),
        "fresh_seconds": round(fresh_seconds, 3),
        "fresh_all_at_once_seconds": round(parallel_seconds, 3),
        "fork_speedup": round(fresh_seconds / fork_seconds, 2) if fork_seconds else None,
        "fork_speedup_vs_all_at_once": (
            round(parallel_seconds / fork_seconds, 2) if fork_seconds else None
        ),
        "method": "fork: create + setup of the source, then ForkSandbox(count) until every fork "
        "is READY (each fork's tree is checked against the checksums afterwards); fresh: count x "
        "(create + setup) one after another (fork_speedup), and all at once",
    }


class ProcessProfiler:
    """py-spy profiles of running processes, one flame graph SVG each, written to ``folder``
    (``written``: name → file name in it)."""

    def __init__(self, folder: Path, prefix: str = "env-profile") -> None:
        self.folder = folder
        self.prefix = prefix
        self.py_spy = _py_spy()
        self.written: dict[str, str] = {}
        self.errors: list[str] = []
        self._running: dict[str, tuple[subprocess.Popen[bytes], Path, float]] = {}
        if self.py_spy is None:
            self.errors.append("py-spy not found (pip install py-spy): no profiles recorded")

    def start(self, name: str, pid: int) -> None:
        """Start sampling ``pid`` as ``name`` (a no-op without py-spy or when already on)."""
        if self.py_spy is None or name in self._running:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        out = self.folder / f"{self.prefix}-{name}.svg"
        process = subprocess.Popen(
            [
                *(self.py_spy, "record", "--pid", str(pid), "--rate", "100", "--nonblocking"),
                *("--format", "flamegraph", "--output", str(out)),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._running[name] = (process, out, time.monotonic())

    def stop(self, name: str) -> None:
        """Stop sampling ``name`` and keep its SVG."""
        entry = self._running.pop(name, None)
        if entry is None:
            return
        process, out, started = entry
        # py-spy needs a moment to attach and take samples: a profile covers at least this.
        time.sleep(max(0.0, started + MIN_PROFILE_S - time.monotonic()))
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            _, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
        if out.is_file():
            self.written[name] = out.name  # in ``folder``, beside the JSON
        else:
            tail = stderr.decode(errors="replace").strip()[-300:]
            self.errors.append(f"py-spy on {name}: no profile ({tail})")

    def close(self) -> None:
        for name in list(self._running):
            self.stop(name)


def _py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file():
        return str(beside)
    return shutil.which("py-spy")


@contextlib.contextmanager
def profiling(profiler: ProcessProfiler | None, name: str, pid: int | None) -> Any:
    """Profile ``pid`` as ``name`` for the duration of the block (nothing without a profiler)."""
    if profiler is None or not pid:
        yield
        return
    profiler.start(name, pid)
    try:
        yield
    finally:
        profiler.stop(name)
