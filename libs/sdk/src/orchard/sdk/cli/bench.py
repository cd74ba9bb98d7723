"""``orchard bench env``: many sandboxes at once through create → wait → K execs → delete.

::

    orchard bench env --sandboxes 100 --execs-per-sandbox 4 --json env.json
    orchard bench env --endpoint 127.0.0.1:7100 --sandboxes 20

By default it runs against a private stack (embedded etcd + orchard-env with the local runtime
in a temporary directory, with its own cgroup parent and run directory, so that no other
service on the host reconciles its sandboxes away), else against ``--endpoint``. In one run:

1. a probe: a few sandboxes, created and measured idle (PSS per sandbox, the service's growth,
   the agent's start CPU), then deleted; from it the concurrency is capped when the asked number
   of sandboxes at once would take more than 70% of MemAvailable (and the output says so);
2. the run: N sandboxes, at most C in flight, each created, waited for, given K execs of the
   command and deleted, while a sampler thread sums PSS (see :mod:`host_probe`);
3. the baseline: the same NxK commands through ``subprocess.run`` from a pool of C threads;
4. the leak check: records the service still lists, cgroups, processes, mounts and (private
   stack) runtime files left behind.

A table goes to stdout, the full result to ``--json``; progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import secrets
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from orchard.sdk.cli.host_probe import (
    MEMORY_METHOD,
    ConcurrencyPlan,
    SandboxCgroups,
    cpu_seconds,
    mem_available_bytes,
    mounts_naming,
    plan_concurrency,
    process_running,
    process_start_time,
    pss_bytes,
    remove_cgroup_parent,
)
from orchard.sdk.cli.output import print_table
from orchard.sdk.errors import OrchardSDKError

__all__ = ["BenchSettings", "EnvBench", "add_bench_commands", "percentile"]

LABEL = "orchard-bench"
PROBE_SANDBOXES = 3
_HEARTBEAT_TIMEOUT_S = 600.0  # longer than any run: no sandbox expires under load
_WAIT_TIMEOUT_S = 300.0
_EXEC_TIMEOUT_S = 60.0
_CLEANUP_CONCURRENCY = 32

TARGETS = {
    "success_rate": (1.0, ">="),
    "leaked": (0, "<="),
    "wall_seconds": (26.0, "<="),
    "exec_p50_ms": (5.0, "<="),
    "idle_sandbox_mb": (10.0, "<="),
}
"""The issue's targets at N=1000, K=4 (shown beside any run for reference)."""


class BenchError(OrchardSDKError):
    """The benchmark could not run; the message says why."""


def add_bench_commands(subparsers: Any, formatter: type[argparse.HelpFormatter]) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks (env: sandboxes through create, exec, delete)",
        description="Benchmarks of Orchard's services on this machine.",
        formatter_class=formatter,
    )
    kinds = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    env = kinds.add_parser(
        "env",
        help="N sandboxes at once: create → wait → K execs → delete, against subprocess.run",
        description=(
            "Run N sandboxes concurrently through create, wait, K execs and delete; report "
            "latencies, success rate, memory (PSS) and leftovers, and the same commands through "
            "subprocess.run as a baseline. Starts a private etcd + orchard-env (local runtime, "
            "needs root) unless --endpoint is given."
        ),
        epilog=(
            "examples:\n"
            "  orchard bench env --sandboxes 100 --execs-per-sandbox 4 --json env.json\n"
            "  orchard bench env --endpoint 127.0.0.1:7100 --sandboxes 20 --concurrency 10"
        ),
        formatter_class=formatter,
    )
    env.add_argument("--sandboxes", "-n", type=int, default=100, help="N (default: 100)")
    env.add_argument(
        "--execs-per-sandbox", "-k", type=int, default=4, help="K execs each (default: 4)"
    )
    env.add_argument(
        "--concurrency",
        "-c",
        type=int,
        help="sandboxes in flight at most (default: N, all at once; lowered when memory "
        "would not suffice)",
    )
    env.add_argument("--command", default="true", help="what each exec runs (default: true)")
    env.add_argument("--image", default="host", help="sandbox image (default: host)")
    env.add_argument("--json", type=Path, metavar="FILE", help="write the full result here")
    env.add_argument(
        "--endpoint",
        dest="bench_endpoint",
        help="use this running environment service instead of a private stack",
    )
    env.add_argument("--token", dest="bench_token", help="its bearer token (with --endpoint)")
    env.add_argument(
        "--service-pid",
        type=int,
        action="append",
        default=[],
        help="with --endpoint: a pid (service, etcd) to count in the memory sum; repeatable",
    )
    env.add_argument(
        "--progress",
        choices=("auto", "bar", "lines", "none"),
        default="auto",
        help="bar on a terminal, plain lines otherwise (default: auto)",
    )
    env.set_defaults(run=_bench_env)


# -- settings and results -----------------------------------------------------------------------


@dataclass(frozen=True)
class BenchSettings:
    """One run's parameters, validated at the command line."""

    sandboxes: int
    execs_per_sandbox: int
    concurrency: int | None
    command: tuple[str, ...]
    image: str = "host"
    probe_sandboxes: int = PROBE_SANDBOXES


@dataclass(frozen=True)
class Target:
    """Where the sandboxes run and what of the host belongs to the service."""

    endpoint: str
    token: str | None
    service_pids: dict[str, int]  # name → pid counted in the memory sum
    runtime_dirs: tuple[str, ...] = ()  # private stack: directories that must end up empty
    private: bool = False


@dataclass
class SandboxTimings:
    create: list[float] = field(default_factory=list)
    ready: list[float] = field(default_factory=list)
    execs: list[float] = field(default_factory=list)
    delete: list[float] = field(default_factory=list)
    agent_start_cpu: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, what: str) -> None:
        self.failures[what] = self.failures.get(what, 0) + 1


def percentile(samples: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, nearest rank on the sorted samples); None when empty."""
    if not samples:
        return None
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _mb(size: float | None) -> float | None:
    return None if size is None else round(size / 2**20, 2)


# -- progress -----------------------------------------------------------------------------------


class BenchProgress:
    """created / ready / done / failed of N: a bar rewritten in place on a terminal, a plain
    line at every tenth otherwise."""

    def __init__(self, total: int, mode: str = "auto", out: IO[str] | None = None) -> None:
        self.out = out or sys.stderr
        self.total = total
        self.mode = ("bar" if self.out.isatty() else "lines") if mode == "auto" else mode
        self.created = self.ready = self.done = self.failed = 0
        self.started = time.monotonic()
        self._last_draw = 0.0
        self._last_tenth = -1

    def update(self, finished: bool = False) -> None:
        if self.mode == "none":
            return
        finished_count = self.done + self.failed
        now = time.monotonic()
        if self.mode == "bar":
            if not finished and now - self._last_draw < 0.1:
                return
            self._last_draw = now
            width = 30
            filled = int(width * finished_count / max(1, self.total))
            self.out.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {self._counts()}\x1b[K")
            if finished:
                self.out.write("\n")
        else:
            # A line at every tenth finished, and at least every 5 s while nothing finishes.
            tenth = 10 * finished_count // max(1, self.total)
            if tenth == self._last_tenth and not finished and now - self._last_draw < 5:
                return
            self._last_tenth = tenth
            self._last_draw = now
            self.out.write(f"  {self._counts()}\n")
        self.out.flush()

    def _counts(self) -> str:
        return (
            f"created {self.created}/{self.total}  ready {self.ready}  done {self.done}  "
            f"failed {self.failed}  {time.monotonic() - self.started:.1f}s"
        )


# -- memory sampling ----------------------------------------------------------------------------


@dataclass
class MemorySample:
    total: int
    sandboxes: int
    live: int
    ready: int = 0  # sandboxes past READY (their agent fully started)
    ready_bytes: int = 0  # their PSS


class MemorySampler:
    """A thread that sums PSS of the service's pids and of the live sandboxes' cgroups."""

    def __init__(
        self, cgroups: SandboxCgroups, service_pids: dict[str, int], seen: dict[int, int]
    ) -> None:
        self.cgroups = cgroups
        self.service_pids = service_pids
        self.live: set[str] = set()
        self.ready: set[str] = set()
        self.lock = threading.Lock()
        self.seen = seen  # pid → start time of every sandbox process seen
        self.peak: MemorySample | None = None
        self.fullest: MemorySample | None = None  # the sample with the most READY sandboxes
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> MemorySample:
        with self.lock:
            ids = list(self.live)
            ready = set(self.ready)
        by_sandbox = self.cgroups.pids(ids)
        sandboxes = ready_bytes = ready_count = 0
        for sandbox_id, pids in by_sandbox.items():
            size = 0
            for pid in pids:
                size += pss_bytes(pid)
                if pid not in self.seen:
                    self.seen[pid] = process_start_time(pid)
            sandboxes += size
            if sandbox_id in ready:
                ready_bytes += size
                ready_count += 1
        service = sum(pss_bytes(pid) for pid in self.service_pids.values() if pid)
        found = MemorySample(
            total=service + sandboxes,
            sandboxes=sandboxes,
            live=len(by_sandbox),
            ready=ready_count,
            ready_bytes=ready_bytes,
        )
        self.samples += 1
        if self.peak is None or found.total > self.peak.total:
            self.peak = found
        if self.fullest is None or found.ready > self.fullest.ready:
            self.fullest = found
        return found

    def _loop(self) -> None:
        interval = 0.25
        while not self._stop.wait(interval):
            began = time.monotonic()
            self.sample()
            # Sampling must not become the load: at most about a fifth of one core.
            interval = max(0.25, 5 * (time.monotonic() - began))

    def __enter__(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._loop, name="pss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


# -- the run ------------------------------------------------------------------------------------


class EnvBench:
    """One benchmark run against ``target`` (see the module docstring)."""

    def __init__(
        self, settings: BenchSettings, target: Target, progress_mode: str = "auto"
    ) -> None:
        self.settings = settings
        self.target = target
        self.progress_mode = progress_mode
        self.run_id = secrets.token_hex(4)
        self.cgroups = SandboxCgroups()
        self.all_ids: set[str] = set()
        self.live: set[str] = set()
        self.seen: dict[int, int] = {}  # pid → start time of every sandbox process seen
        self.notes: list[str] = []

    async def run(self) -> dict[str, Any]:
        from orchard.sdk.aio import AsyncSandboxClient  # noqa: PLC0415
        from orchard.sdk.retry import RetryPolicy  # noqa: PLC0415

        retry = RetryPolicy(max_attempts=5, initial_backoff=0.05, max_backoff=1.0)
        async with AsyncSandboxClient(
            self.target.endpoint, token=self.target.token, retry=retry, timeout=60.0
        ) as client:
            try:
                probe = await self._probe(client)
                plan = self._plan(probe)
                if plan.capped_by_memory:
                    sys.stderr.write(f"orchard bench: {plan.explain()}\n")
                run = await self._main(client, plan.concurrency)
            finally:
                await self._delete_leftovers(client)
            leaks = await self._leaks(client)
        baseline = await asyncio.to_thread(self._baseline, plan.concurrency)
        return self._result(probe, plan, run, baseline, leaks)

    # -- phases ------------------------------------------------------------------------------

    async def _probe(self, client: Any) -> dict[str, Any]:
        """Create a few sandboxes, measure them idle, delete them."""
        count = min(self.settings.probe_sandboxes, self.settings.sandboxes)
        sampler = MemorySampler(self.cgroups, self.target.service_pids, self.seen)
        before = sampler.sample()
        created = await asyncio.gather(
            *(self._create(client, f"probe-{i}") for i in range(count)), return_exceptions=True
        )
        sandboxes = [s for s in created if not isinstance(s, BaseException)]
        errors = [s for s in created if isinstance(s, BaseException)]
        if not sandboxes:
            raise BenchError(f"no probe sandbox became ready: {errors[0]}")
        if not self.cgroups.locate(sandboxes[0].id):
            self.notes.append("sandbox cgroups not found on this host: sandbox memory is 0")
        agent_cpu = [self._sandbox_cpu(s.id) for s in sandboxes]
        await asyncio.sleep(0.5)  # let the agents settle into idle
        sampler.live = {s.id for s in sandboxes}
        after = sampler.sample()
        await asyncio.gather(*(self._delete(client, s.id) for s in sandboxes))
        return {
            "sandboxes": len(sandboxes),
            "idle_sandbox_bytes": after.sandboxes / len(sandboxes),
            "memory_per_sandbox_bytes": max(0, after.total - before.total) / len(sandboxes),
            "service_bytes": before.total,
            "agent_start_cpu_s": statistics.fmean(agent_cpu),
        }

    def _plan(self, probe: dict[str, Any]) -> ConcurrencyPlan:
        requested = min(
            self.settings.concurrency or self.settings.sandboxes, self.settings.sandboxes
        )
        # The larger of the two estimates: the service's own growth per sandbox counts too.
        per_sandbox = int(max(probe["memory_per_sandbox_bytes"], probe["idle_sandbox_bytes"]))
        return plan_concurrency(requested, per_sandbox, mem_available_bytes())

    async def _main(self, client: Any, concurrency: int) -> dict[str, Any]:
        total = self.settings.sandboxes
        timings = SandboxTimings()
        progress = BenchProgress(total, self.progress_mode)
        slots = asyncio.Semaphore(concurrency)
        sampler = MemorySampler(self.cgroups, self.target.service_pids, self.seen)
        cpu_before = self._cpu_snapshot()

        async def one(index: int) -> None:
            async with slots:
                ok = await self._lifecycle(client, index, timings, progress, sampler)
            if ok:
                progress.done += 1
            else:
                progress.failed += 1
            progress.update()

        began = time.perf_counter()
        with sampler:
            await asyncio.gather(*(one(i) for i in range(total)))
        wall = time.perf_counter() - began
        progress.update(finished=True)
        cpu_after = self._cpu_snapshot()
        return {
            "timings": timings,
            "wall_seconds": wall,
            "succeeded": progress.done,
            "sampler": sampler,
            "cpu": {k: cpu_after[k] - cpu_before[k] for k in cpu_before},
        }

    async def _lifecycle(
        self,
        client: Any,
        index: int,
        timings: SandboxTimings,
        progress: BenchProgress,
        sampler: MemorySampler,
    ) -> bool:
        from orchard.sdk.errors import OrchardSDKError as SDKError  # noqa: PLC0415

        t0 = time.perf_counter()
        try:
            sandbox = await client.create(
                self.settings.image,
                labels={LABEL: self.run_id, "index": str(index)},
                heartbeat_timeout=_HEARTBEAT_TIMEOUT_S,
                wait=False,
                keep_alive=False,
            )
        except SDKError as exc:
            timings.fail(f"create:{type(exc).__name__}")
            if len(self.notes) < 5:
                self.notes.append(f"create #{index}: {str(exc)[:300]}")
            return False
        timings.create.append(time.perf_counter() - t0)
        self._track(sandbox.id, sampler)
        progress.created += 1
        progress.update()
        ok = True
        try:
            await sandbox.wait(timeout=_WAIT_TIMEOUT_S)
            timings.ready.append(time.perf_counter() - t0)
            timings.agent_start_cpu.append(self._sandbox_cpu(sandbox.id))
            with sampler.lock:
                sampler.ready.add(sandbox.id)
            progress.ready += 1
            progress.update()
            for _ in range(self.settings.execs_per_sandbox):
                t_exec = time.perf_counter()
                result = await sandbox.exec(list(self.settings.command), timeout=_EXEC_TIMEOUT_S)
                timings.execs.append(time.perf_counter() - t_exec)
                if result.exit_code != 0:
                    timings.fail("exec_status")
                    ok = False
        except SDKError as exc:
            reason = getattr(exc, "failure_reason", "") or getattr(exc, "reason", "")
            timings.fail(f"{type(exc).__name__}:{reason}" if reason else type(exc).__name__)
            if len(self.notes) < 5:
                self.notes.append(f"sandbox {sandbox.id}: {str(exc)[:300]}")
            ok = False
        t_delete = time.perf_counter()
        try:
            await self._delete(client, sandbox.id, sampler)
            timings.delete.append(time.perf_counter() - t_delete)
        except SDKError:
            timings.fail("delete")
            ok = False
        return ok

    def _baseline(self, concurrency: int) -> dict[str, Any]:
        """The same NxK commands through subprocess.run, C threads, K in a row per task."""
        command = list(self.settings.command)
        latencies: list[float] = []
        failed = 0
        lock = threading.Lock()

        def task() -> None:
            nonlocal failed
            mine: list[float] = []
            bad = 0
            for _ in range(self.settings.execs_per_sandbox):
                t0 = time.perf_counter()
                done = subprocess.run(command, capture_output=True, check=False)
                mine.append(time.perf_counter() - t0)
                bad += done.returncode != 0
            with lock:
                latencies.extend(mine)
                failed += bad

        began = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            for future in [pool.submit(task) for _ in range(self.settings.sandboxes)]:
                future.result()
        return {
            "wall_seconds": time.perf_counter() - began,
            "latencies": latencies,
            "failed": failed,
            "threads": concurrency,
        }

    async def _leaks(self, client: Any) -> dict[str, int]:
        records = [info.id async for info in client.list({LABEL: self.run_id})]
        cgroups = [i for i in self.all_ids if self.cgroups.dirs(i)]
        processes = sum(
            1 for pid, start in self.seen.items() if start and process_running(pid, start)
        )
        mounts = mounts_naming(self.all_ids)
        runtime_files = 0
        names = self.all_ids | {f"{i}.json" for i in self.all_ids}
        for directory in self.target.runtime_dirs:
            with contextlib.suppress(FileNotFoundError):
                runtime_files += sum(1 for e in os.scandir(directory) if e.name in names)
        return {
            "records": len(records),
            "cgroups": len(cgroups),
            "processes": processes,
            "mounts": len(mounts),
            "runtime_files": runtime_files,
        }

    # -- helpers -----------------------------------------------------------------------------

    async def _create(self, client: Any, tag: str) -> Any:
        sandbox = await client.create(
            self.settings.image,
            labels={LABEL: self.run_id, "index": tag},
            heartbeat_timeout=_HEARTBEAT_TIMEOUT_S,
            wait=False,
            keep_alive=False,
        )
        self._track(sandbox.id, None)
        await sandbox.wait(timeout=_WAIT_TIMEOUT_S)
        return sandbox

    def _track(self, sandbox_id: str, sampler: MemorySampler | None) -> None:
        self.all_ids.add(sandbox_id)
        self.live.add(sandbox_id)
        if sampler is not None:
            with sampler.lock:
                sampler.live.add(sandbox_id)

    async def _delete(
        self, client: Any, sandbox_id: str, sampler: MemorySampler | None = None
    ) -> None:
        if sampler is not None:
            # Sample this sandbox's processes once more so that a leaked one is known.
            for pid in self.cgroups.pids([sandbox_id]).get(sandbox_id, ()):
                sampler.seen.setdefault(pid, process_start_time(pid))
            with sampler.lock:
                sampler.live.discard(sandbox_id)
                sampler.ready.discard(sandbox_id)
        await client.delete(sandbox_id)
        self.live.discard(sandbox_id)

    async def _delete_leftovers(self, client: Any) -> None:
        """Delete whatever this run created and did not delete (failure, Ctrl-C)."""
        if not self.live:
            return
        slots = asyncio.Semaphore(_CLEANUP_CONCURRENCY)

        async def one(sandbox_id: str) -> None:
            async with slots:
                with contextlib.suppress(Exception):
                    await self._delete(client, sandbox_id)

        await asyncio.shield(asyncio.gather(*(one(i) for i in list(self.live))))

    def _sandbox_cpu(self, sandbox_id: str) -> float:
        pids = self.cgroups.pids([sandbox_id]).get(sandbox_id, set())
        return sum(cpu_seconds(pid) for pid in pids)

    def _cpu_snapshot(self) -> dict[str, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        snapshot = {"bench_client": usage.ru_utime + usage.ru_stime}
        for name, pid in self.target.service_pids.items():
            snapshot[name] = cpu_seconds(pid)
            snapshot[f"{name}_children"] = cpu_seconds(pid, children=True)
        return snapshot

    # -- the result --------------------------------------------------------------------------

    def _result(
        self,
        probe: dict[str, Any],
        plan: ConcurrencyPlan,
        run: dict[str, Any],
        baseline: dict[str, Any],
        leaks: dict[str, int],
    ) -> dict[str, Any]:
        timings: SandboxTimings = run["timings"]
        sampler: MemorySampler = run["sampler"]
        n, k = self.settings.sandboxes, self.settings.execs_per_sandbox
        exec_p50 = percentile(timings.execs, 50)
        base_p50 = percentile(baseline["latencies"], 50)
        fullest = sampler.fullest
        cpu = {name: round(value, 3) for name, value in run["cpu"].items()}
        cpu["agent_start"] = round(sum(timings.agent_start_cpu), 3)
        result: dict[str, Any] = {
            "benchmark": "env",
            "time": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "kernel": platform.release(),
                "mem_available_mb": _mb(plan.mem_available_bytes),
            },
            "stack": "private" if self.target.private else "endpoint",
            "image": self.settings.image,
            "command": shlex.join(self.settings.command),
            "sandboxes": n,
            "execs_per_sandbox": k,
            "execs": len(timings.execs),
            "success_rate": round(run["succeeded"] / n, 4),
            "failures": timings.failures,
            "concurrency": plan.concurrency,
            "concurrency_requested": plan.requested,
            "concurrency_capped_by_memory": plan.capped_by_memory,
            "concurrency_note": plan.explain(),
            "wall_seconds": round(run["wall_seconds"], 3),
            "create_p50_ms": _ms(percentile(timings.create, 50)),
            "create_p99_ms": _ms(percentile(timings.create, 99)),
            "ready_p50_ms": _ms(percentile(timings.ready, 50)),
            "ready_p99_ms": _ms(percentile(timings.ready, 99)),
            "exec_p50_ms": _ms(exec_p50),
            "exec_p99_ms": _ms(percentile(timings.execs, 99)),
            "delete_p50_ms": _ms(percentile(timings.delete, 50)),
            "delete_p99_ms": _ms(percentile(timings.delete, 99)),
            "sandboxes_per_second": round(n / run["wall_seconds"], 2),
            "leaked": sum(leaks.values()),
            "leaked_detail": leaks,
            "peak_rss_mb": _mb(sampler.peak.total if sampler.peak else None),
            "peak_sandboxes_live": sampler.peak.live if sampler.peak else 0,
            "memory_method": MEMORY_METHOD,
            "memory_samples": sampler.samples,
            # PSS splits shared pages among the sandboxes that map them, so the per-sandbox
            # figure falls as more run: the run's is the one at the most READY sandboxes.
            "idle_sandbox_mb": _mb(fullest.ready_bytes / fullest.ready)
            if fullest and fullest.ready
            else _mb(probe["idle_sandbox_bytes"]),
            "idle_sandbox_measured_with": fullest.ready if fullest else 0,
            "probe_idle_sandbox_mb": _mb(probe["idle_sandbox_bytes"]),
            "probe_memory_per_sandbox_mb": _mb(probe["memory_per_sandbox_bytes"]),
            "service_mb_idle": _mb(probe["service_bytes"]),
            "probe_sandboxes": probe["sandboxes"],
            "cpu_seconds": cpu,
            "agent_start_cpu_ms_p50": _ms(percentile(timings.agent_start_cpu, 50)),
            "baseline": {
                "method": "subprocess.run of the same command, N tasks of K runs each, "
                "on a pool of C threads",
                "execs": len(baseline["latencies"]),
                "failed": baseline["failed"],
                "threads": baseline["threads"],
                "wall_seconds": round(baseline["wall_seconds"], 3),
                "exec_p50_ms": _ms(base_p50),
                "exec_p99_ms": _ms(percentile(baseline["latencies"], 99)),
            },
            "exec_p50_vs_baseline": round(exec_p50 / base_p50, 2)
            if exec_p50 and base_p50
            else None,
            "notes": self.notes,
        }
        result["targets_at_1000x4"] = {
            name: {"target": goal, "met": _met(result.get(name), goal, how)}
            for name, (goal, how) in TARGETS.items()
        }
        return result


def _met(value: float | None, goal: float, how: str) -> bool | None:
    if value is None:
        return None
    return value >= goal if how == ">=" else value <= goal


# -- the command --------------------------------------------------------------------------------


def _bench_env(args: argparse.Namespace) -> int:
    from orchard.sdk.cli.sandbox import UsageError  # noqa: PLC0415

    if args.sandboxes < 1:
        raise UsageError("--sandboxes must be at least 1")
    if args.execs_per_sandbox < 0:
        raise UsageError("--execs-per-sandbox must be 0 or more")
    if args.concurrency is not None and args.concurrency < 1:
        raise UsageError("--concurrency must be at least 1")
    command = tuple(shlex.split(args.command))
    if not command:
        raise UsageError("--command must not be empty")
    settings = BenchSettings(
        sandboxes=args.sandboxes,
        execs_per_sandbox=args.execs_per_sandbox,
        concurrency=args.concurrency,
        command=command,
        image=args.image,
    )
    endpoint = args.bench_endpoint or args.endpoint
    if endpoint:
        token = args.bench_token or args.token
        pids = {f"pid{pid}": pid for pid in args.service_pid}
        target = Target(endpoint=endpoint, token=token, service_pids=pids)
        result = _run_async(EnvBench(settings, target, args.progress).run)
    else:
        result = run_on_private_stack(settings, args.progress)
    show(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print(f"\nwrote {args.json}")
    return 0 if result["success_rate"] == 1.0 and result["leaked"] == 0 else 1


def run_on_private_stack(settings: BenchSettings, progress: str = "auto") -> dict[str, Any]:
    """Start a private etcd + orchard-env in a temporary directory, run, stop, clean up."""
    from orchard.sdk.cli.stack import LocalStack, StackError  # noqa: PLC0415

    if os.geteuid() != 0:
        raise BenchError("the private stack's local runtime needs root; or pass --endpoint")
    tag = secrets.token_hex(3)
    state = Path(tempfile.mkdtemp(prefix="orchard-bench-"))
    cgroup_parent = f"orchard-bench-{tag}"
    run_dir = f"/run/orchard-bench-{tag}"  # short: socket paths must fit in 107 bytes
    token = secrets.token_urlsafe(24)
    stack = LocalStack(
        state,
        listen=f"127.0.0.1:{_free_port()}",
        token=token,
        runtime={"cgroup_parent": cgroup_parent, "run_dir": run_dir},
    )
    sys.stderr.write(f"orchard bench: starting a private etcd + orchard-env in {state}\n")
    try:
        try:
            stack.start()
        except StackError as exc:
            raise BenchError(str(exc)) from None
        runtime = stack.runtime_settings()
        target = Target(
            endpoint=stack.endpoint,
            token=token,
            service_pids={"orchard_env": stack.env_pid, "etcd": stack.etcd_pid},
            runtime_dirs=(runtime["state_dir"], runtime["workspace_dir"], run_dir),
            private=True,
        )
        result = _run_async(EnvBench(settings, target, progress).run)
        if not stack.alive():
            result["notes"].append("orchard-env exited during the run")
        return result
    finally:
        stack.stop()
        remove_cgroup_parent(cgroup_parent)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)


def _run_async(run: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Run on a fresh loop; SIGTERM cancels like Ctrl-C, so cleanup still runs."""

    async def main() -> dict[str, Any]:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await run()
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    return asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def show(result: dict[str, Any], out: IO[str] | None = None) -> None:
    """The short table a person reads."""
    out = out or sys.stdout
    base = result["baseline"]
    targets = result["targets_at_1000x4"]

    def goal(name: str) -> str:
        entry = targets.get(name)
        if entry is None:
            return ""
        mark = {True: "met", False: "MISSED", None: "-"}[entry["met"]]
        return f"{entry['target']} ({mark})"

    rows = [
        ["sandboxes x execs", f"{result['sandboxes']} x {result['execs_per_sandbox']}", ""],
        [
            "concurrency",
            f"{result['concurrency']}"
            + (" (capped by memory)" if result["concurrency_capped_by_memory"] else ""),
            "",
        ],
        ["success rate", result["success_rate"], goal("success_rate")],
        ["wall s", result["wall_seconds"], goal("wall_seconds")],
        ["create p50 ms", result["create_p50_ms"], ""],
        ["ready p50 / p99 ms", f"{result['ready_p50_ms']} / {result['ready_p99_ms']}", ""],
        ["exec p50 ms", result["exec_p50_ms"], goal("exec_p50_ms")],
        ["exec p99 ms", result["exec_p99_ms"], ""],
        ["delete p50 ms", result["delete_p50_ms"], ""],
        ["leaked", result["leaked"], goal("leaked")],
        ["peak PSS MB (service+sandboxes)", result["peak_rss_mb"], ""],
        [
            f"sandbox MB (PSS, {result['idle_sandbox_measured_with']} ready)",
            result["idle_sandbox_mb"],
            goal("idle_sandbox_mb"),
        ],
        [
            "probe: sandbox MB / with service share",
            f"{result['probe_idle_sandbox_mb']} / {result['probe_memory_per_sandbox_mb']}",
            "",
        ],
        [
            "subprocess.run p50 / p99 ms",
            f"{base['exec_p50_ms']} / {base['exec_p99_ms']}",
            "",
        ],
        ["exec p50 vs subprocess.run", result["exec_p50_vs_baseline"], ""],
    ]
    print_table(["metric", "value", "target at 1000x4"], rows, out)
    if result["concurrency_note"]:
        out.write(f"\nnote: {result['concurrency_note']}\n")
    for note in result["notes"]:
        out.write(f"note: {note}\n")
