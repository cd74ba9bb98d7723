"""``orchard bench env``: many sandboxes at once through create → wait → K execs → delete.

::

    orchard bench env --sandboxes 100 --execs-per-sandbox 4 --json env.json
    orchard bench env --curve 100,400,1000 --profile --json bench/results/env.json
    orchard bench env --endpoint 127.0.0.1:7100 --sandboxes 20

By default it runs against a private stack (embedded etcd + orchard-env with the local runtime
in a temporary directory, with its own cgroup parent and run directory, so that no other
service on the host reconciles its sandboxes away), else against ``--endpoint``. In one run:

1. a probe: a few sandboxes, created and measured idle (PSS per sandbox, the service's growth,
   the agent's start CPU), then deleted; from it the concurrency is capped when the asked number
   of sandboxes at once would take more than 70% of MemAvailable (and the output says so);
2. the figures, each beside its floor (see :mod:`bench_figures`): exec round trip, sustained
   execs/s, a burst of concurrent execs and the CPU per exec by process, against
   ``subprocess.run``; create → READY against a bare namespaced spawn; fork against fresh
   sandboxes with the same setup;
3. the run (the lifecycle): N sandboxes, at most C in flight, each created, waited for, given K
   execs of the command and deleted, while a sampler thread sums PSS (see :mod:`host_probe`),
   with the CPU per sandbox lifecycle by process; ``--curve`` runs it at several sizes;
4. the baseline: the same NxK commands through ``subprocess.run`` from a pool of C threads;
5. the leak check: records the service still lists, cgroups, processes, mounts and (private
   stack) runtime files left behind.

On the private stack, orchard-env and etcd run in cgroup v1 ``cpuacct`` groups of their own
(where the host has that hierarchy), so the CPU of every sandbox, agent, command and the
kernel's work for them is counted even after the sandbox is gone. ``--profile`` records py-spy
flame graphs of orchard-env and one agent beside the JSON.

A table goes to stdout, the full result to ``--json``; progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
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

from orchard.sdk.cli.bench_figures import (
    ExecSettings,
    ProcessProfiler,
    exec_figures,
    fork_figures,
    profiling,
    ready_figures,
)
from orchard.sdk.cli.host_probe import (
    MEMORY_METHOD,
    ConcurrencyPlan,
    CpuAccounting,
    CpuTimes,
    SandboxCgroups,
    cpu_seconds,
    host_cpu,
    mem_available_bytes,
    mounts_naming,
    plan_concurrency,
    process_cpu,
    process_running,
    process_start_time,
    pss_bytes,
    remove_cgroup_parent,
    this_process_cpu,
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
    "cpu_ms_per_lifecycle": (50.0, "<="),
    "exec_cpu_ms": (2.0, "<="),
    "exec_round_trip_p50_ms": (3.0, "<="),
    "execs_per_second": (1000.0, ">="),
    "exec_burst_p50_ms": (1000.0, "<="),
    "create_to_ready_p50_ms": (20.0, "<="),
    "fork_speedup": (5.0, ">="),
}
"""The targets at N=1000, K=4 (shown beside any run for reference)."""
_RUN_TARGETS = ("success_rate", "leaked", "wall_seconds", "exec_p50_ms", "idle_sandbox_mb")
"""Those read from the lifecycle run's own fields; the rest from the figures."""


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
        "--curve",
        metavar="N,N,...",
        help="run the lifecycle at each of these sizes in one invocation (e.g. 100,400,1000); "
        "the largest is the run the table shows",
    )
    env.add_argument(
        "--exec-sandboxes",
        type=int,
        default=50,
        help="sandboxes the exec figures run on (default: 50, at most N; 0 skips the exec, "
        "create and fork figures)",
    )
    env.add_argument(
        "--exec-calls", type=int, default=300, help="one-at-a-time execs timed (default: 300)"
    )
    env.add_argument(
        "--exec-sustained", type=int, default=3000, help="execs of the sustained rate (3000)"
    )
    env.add_argument(
        "--exec-concurrency", type=int, default=32, help="execs in flight, sustained (32)"
    )
    env.add_argument(
        "--exec-burst", type=int, default=1000, help="execs started at once (default: 1000)"
    )
    env.add_argument(
        "--ready-repeats", type=int, default=20, help="single creates timed to READY (20)"
    )
    env.add_argument("--fork", type=int, default=8, help="K of the fork figure (default: 8)")
    env.add_argument(
        "--profile",
        action="store_true",
        help="record py-spy flame graphs of orchard-env and one agent (private stack) next to "
        "--json",
    )
    env.add_argument(
        "--direct-agent",
        action="store_true",
        help="exec on the agents directly (the client's direct route) instead of through "
        "orchard-env",
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
    curve: tuple[int, ...] = ()
    """Lifecycle sizes to run, smallest first; empty: just ``sandboxes``."""
    exec_sandboxes: int = 50
    exec: ExecSettings | None = None
    ready_repeats: int = 20
    fork: int = 8
    profile_dir: Path | None = None
    direct_agent: bool = False

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.curve or (self.sandboxes,)


@dataclass(frozen=True)
class Target:
    """Where the sandboxes run and what of the host belongs to the service."""

    endpoint: str
    token: str | None
    service_pids: dict[str, int]  # name → pid counted in the memory sum
    runtime_dirs: tuple[str, ...] = ()  # private stack: directories that must end up empty
    private: bool = False
    accounting: CpuAccounting | None = None  # cpuacct groups "orchard-env" and "etcd"


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
        sizes = self.settings.sizes
        profiler = ProcessProfiler(self.settings.profile_dir) if self.settings.profile_dir else None
        env_pid = self.target.service_pids.get("orchard_env")
        runs: list[tuple[int, ConcurrencyPlan, dict[str, Any]]] = []
        async with AsyncSandboxClient(
            self.target.endpoint,
            token=self.target.token,
            retry=retry,
            timeout=60.0,
            direct_agent=self.settings.direct_agent,
        ) as client:
            try:
                probe = await self._probe(client)
                figures = await self._figures(client, profiler)
                for size in sizes:
                    plan = self._plan(probe, size)
                    if plan.capped_by_memory:
                        sys.stderr.write(f"orchard bench: {plan.explain()}\n")
                    if len(sizes) > 1:
                        sys.stderr.write(f"orchard bench: lifecycle of {size} sandboxes\n")
                    largest = size == sizes[-1]
                    with profiling(profiler, "orchard-env", env_pid if largest else None):
                        run = await self._main(client, plan.concurrency, size)
                    runs.append((size, plan, run))
            finally:
                if profiler is not None:
                    profiler.close()
                await self._delete_leftovers(client)
            leaks = await self._leaks(client)
        size, plan, run = runs[-1]
        baseline = await asyncio.to_thread(self._baseline, plan.concurrency, size)
        result = self._result(probe, plan, run, baseline, leaks, n=size)
        result["figures"] = figures
        result["curve"] = [_curve_entry(n, p, r) for n, p, r in runs]
        _add_figure_targets(result)
        if profiler is not None:
            result["profiles"] = profiler.written
            result["notes"].extend(profiler.errors)
        return result

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

    async def _figures(self, client: Any, profiler: ProcessProfiler | None) -> dict[str, Any]:
        """Exec, create → READY and fork, each beside its floor (see :mod:`bench_figures`)."""
        count = min(self.settings.exec_sandboxes, max(self.settings.sizes))
        if count <= 0 or self.settings.exec is None:
            return {}
        figures: dict[str, Any] = {}
        env_pid = self.target.service_pids.get("orchard_env")
        sys.stderr.write(f"orchard bench: exec figures on {count} sandboxes\n")
        created = await asyncio.gather(
            *(self._create(client, f"exec-{i}") for i in range(count)), return_exceptions=True
        )
        sandboxes = [s for s in created if not isinstance(s, BaseException)]
        try:
            if len(sandboxes) < count:
                error = next(s for s in created if isinstance(s, BaseException))
                raise BenchError(f"exec figures: a sandbox did not become ready: {error}")
            with profiling(profiler, "orchard-env-exec", env_pid):
                figures["exec"] = await exec_figures(
                    client,
                    sandboxes,
                    self.settings.exec,
                    service_pid=env_pid,
                    cgroups=self.cgroups,
                    accounting=self.target.accounting,
                    profiler=profiler,
                )
        except Exception as exc:  # one figure failing must not hide the others
            figures["exec"] = {"error": str(exc)[:500]}
        finally:
            await asyncio.gather(
                *(self._delete(client, s.id) for s in sandboxes), return_exceptions=True
            )

        async def create() -> Any:
            sandbox = await client.create(
                self.settings.image,
                labels={LABEL: self.run_id, "index": "figure"},
                heartbeat_timeout=_HEARTBEAT_TIMEOUT_S,
                wait=False,
                keep_alive=False,
            )
            self._track(sandbox.id, None)
            return sandbox

        async def delete(sandbox: Any) -> None:
            await self._delete(client, sandbox.id)

        if self.settings.ready_repeats > 0:
            sys.stderr.write("orchard bench: create -> READY, one at a time\n")
            try:
                figures["ready"] = await ready_figures(create, delete, self.settings.ready_repeats)
            except Exception as exc:
                figures["ready"] = {"error": str(exc)[:500]}
        if self.settings.fork > 0:
            sys.stderr.write(f"orchard bench: fork of {self.settings.fork}\n")
            try:
                figures["fork"] = await fork_figures(
                    client,
                    create,
                    delete,
                    self.settings.fork,
                    {LABEL: self.run_id, "index": "fork"},
                    track=lambda sandbox: self._track(sandbox.id, None),
                )
            except Exception as exc:
                figures["fork"] = {"error": str(exc)[:500]}
        return figures

    def _plan(self, probe: dict[str, Any], sandboxes: int) -> ConcurrencyPlan:
        requested = min(self.settings.concurrency or sandboxes, sandboxes)
        # The larger of the two estimates: the service's own growth per sandbox counts too.
        per_sandbox = int(max(probe["memory_per_sandbox_bytes"], probe["idle_sandbox_bytes"]))
        return plan_concurrency(requested, per_sandbox, mem_available_bytes())

    async def _main(self, client: Any, concurrency: int, total: int) -> dict[str, Any]:
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

    def _baseline(self, concurrency: int, sandboxes: int) -> dict[str, Any]:
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
            for future in [pool.submit(task) for _ in range(sandboxes)]:
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

    def _cpu_snapshot(self) -> dict[str, CpuTimes]:
        snapshot = {"bench_client": this_process_cpu(), "host": host_cpu()}
        for name, pid in self.target.service_pids.items():
            snapshot[name] = process_cpu(pid)
            snapshot[f"{name}_children"] = process_cpu(pid, children=True)
        accounting = self.target.accounting
        if accounting is not None:
            for group in accounting.groups:
                found = accounting.read(group)
                if found is not None:
                    snapshot[f"cgroup_{group}"] = found
        return snapshot

    # -- the result --------------------------------------------------------------------------

    def _result(
        self,
        probe: dict[str, Any],
        plan: ConcurrencyPlan,
        run: dict[str, Any],
        baseline: dict[str, Any],
        leaks: dict[str, int],
        *,
        n: int,
    ) -> dict[str, Any]:
        timings: SandboxTimings = run["timings"]
        sampler: MemorySampler = run["sampler"]
        k = self.settings.execs_per_sandbox
        exec_p50 = percentile(timings.execs, 50)
        base_p50 = percentile(baseline["latencies"], 50)
        fullest = sampler.fullest
        cpu = {name: round(value.total, 3) for name, value in run["cpu"].items()}
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
            "cpu_ms_per_lifecycle": lifecycle_cpu(run["cpu"], n),
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
            if name in _RUN_TARGETS
        }
        return result


def lifecycle_cpu(delta: dict[str, CpuTimes], sandboxes: int) -> dict[str, Any]:
    """CPU per sandbox lifecycle (ms), by process, from one run's before/after difference."""
    none = CpuTimes()
    client = delta.get("bench_client", none)
    env = delta.get("orchard_env", none)
    etcd = delta.get("cgroup_etcd") or delta.get("etcd", none)
    group = delta.get("cgroup_orchard-env")
    split: dict[str, Any] = {
        "client": client.per(sandboxes),
        "orchard_env": env.per(sandboxes),
        "etcd": etcd.per(sandboxes),
    }
    if group is not None:
        # Everything orchard-env started, gone or not: agents, commands, sandbox setup, and
        # the kernel's work in those processes.
        split["sandboxes"] = (group - env).per(sandboxes)
        total = client + group + etcd
        split["method"] = (
            "client: getrusage; orchard-env: /proc/PID/stat; sandboxes: cgroup v1 cpuacct "
            "of orchard-env and all it started, less orchard-env itself; etcd: its cpuacct group"
        )
    else:
        children = delta.get("orchard_env_children", none)
        split["orchard_env_children"] = children.per(sandboxes)
        total = client + env + children + etcd
        split["method"] = (
            "/proc/PID/stat only (no cpuacct hierarchy): sandbox processes that orchard-env "
            "did not reap itself are missing"
        )
    split["all"] = total.per(sandboxes)
    # The whole machine, others' load included: an upper bound on a shared host.
    split["host"] = delta.get("host", none).per(sandboxes)
    return split


def _curve_entry(size: int, plan: ConcurrencyPlan, run: dict[str, Any]) -> dict[str, Any]:
    timings: SandboxTimings = run["timings"]
    return {
        "sandboxes": size,
        "concurrency": plan.concurrency,
        "wall_seconds": round(run["wall_seconds"], 3),
        "success_rate": round(run["succeeded"] / size, 4),
        "ready_p50_ms": _ms(percentile(timings.ready, 50)),
        "exec_p50_ms": _ms(percentile(timings.execs, 50)),
        "cpu_ms_per_lifecycle": lifecycle_cpu(run["cpu"], size),
    }


def _add_figure_targets(result: dict[str, Any]) -> None:
    """The figures' values beside their targets (in ``targets_at_1000x4``)."""
    figures = result.get("figures", {})
    exec_ = figures.get("exec", {})
    sustained = exec_.get("sustained", {})
    values = {
        "cpu_ms_per_lifecycle": result["cpu_ms_per_lifecycle"]["all"]["total"],
        "exec_cpu_ms": sustained.get("cpu_ms_per_exec", {}).get("all", {}).get("total"),
        "exec_round_trip_p50_ms": exec_.get("single_round_trip_p50_ms"),
        "execs_per_second": sustained.get("execs_per_second"),
        "exec_burst_p50_ms": exec_.get("burst", {}).get("p50_ms"),
        "create_to_ready_p50_ms": figures.get("ready", {}).get("create_to_ready_p50_ms"),
        "fork_speedup": figures.get("fork", {}).get("fork_speedup"),
    }
    for name, value in values.items():
        goal, how = TARGETS[name]
        result["targets_at_1000x4"][name] = {
            "target": goal,
            "value": value,
            "met": _met(value, goal, how),
        }


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
    curve: tuple[int, ...] = ()
    if args.curve:
        try:
            curve = tuple(sorted({int(part) for part in args.curve.split(",") if part.strip()}))
        except ValueError:
            raise UsageError(
                f"--curve: {args.curve!r} is not a list of sizes like 100,400,1000"
            ) from None
        if not curve or curve[0] < 1:
            raise UsageError("--curve: every size must be at least 1")
    for name in ("exec_sandboxes", "ready_repeats", "fork"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be 0 or more")
    for name in ("exec_calls", "exec_sustained", "exec_concurrency", "exec_burst"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.fork > 64:
        raise UsageError("--fork: at most 64 forks per call")
    profile_dir = None
    if args.profile:
        profile_dir = args.json.parent if args.json else Path.cwd()
    settings = BenchSettings(
        sandboxes=max(curve) if curve else args.sandboxes,
        execs_per_sandbox=args.execs_per_sandbox,
        concurrency=args.concurrency,
        command=command,
        image=args.image,
        curve=curve,
        exec_sandboxes=args.exec_sandboxes,
        exec=ExecSettings(
            command=command,
            sequential_calls=args.exec_calls,
            sustained_calls=args.exec_sustained,
            concurrency=args.exec_concurrency,
            burst=args.exec_burst,
        ),
        ready_repeats=args.ready_repeats,
        fork=args.fork,
        profile_dir=profile_dir,
        direct_agent=args.direct_agent,
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
    accounting: CpuAccounting | None = None
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
        # Before any sandbox exists: all it starts inherits orchard-env's group.
        accounting = CpuAccounting(f"orchard-bench-{tag}")
        counted = accounting.add("orchard-env", stack.env_pid) and accounting.add(
            "etcd", stack.etcd_pid
        )
        target = Target(
            endpoint=stack.endpoint,
            token=token,
            service_pids={"orchard_env": stack.env_pid, "etcd": stack.etcd_pid},
            runtime_dirs=(runtime["state_dir"], runtime["workspace_dir"], run_dir),
            private=True,
            accounting=accounting if counted else None,
        )
        result = _run_async(EnvBench(settings, target, progress).run)
        if not stack.alive():
            result["notes"].append("orchard-env exited during the run")
        return result
    finally:
        stack.stop()
        if accounting is not None:
            accounting.remove()
        remove_cgroup_parent(cgroup_parent)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)


def _split_text(split: dict[str, Any]) -> str:
    """``name total (sys system)`` for each process in a CPU split."""
    parts = []
    for name, value in split.items():
        # "all" and "host" are shown on rows of their own; a cgroup total is a cross-check.
        shown = name not in ("all", "host") and not name.startswith("cgroup")
        if shown and isinstance(value, dict):
            parts.append(f"{name} {value['total']} (sys {value['system']})")
    return ", ".join(parts)


def _figure_rows(result: dict[str, Any], goal: Callable[[str], str]) -> list[list[Any]]:
    figures = result.get("figures", {})
    rows: list[list[Any]] = []
    for name, figure in figures.items():
        if "error" in figure:
            rows.append([name, f"failed: {figure['error'][:80]}", "", ""])
    exec_ = figures.get("exec", {})
    if "sustained" in exec_:
        floor = exec_["floor"]
        sustained = exec_["sustained"]
        cpu = sustained["cpu_ms_per_exec"]
        rows += [
            [
                "exec round trip p50 ms",
                exec_["single_round_trip_p50_ms"],
                floor["single_round_trip_p50_ms"],
                goal("exec_round_trip_p50_ms"),
            ],
            [
                f"execs/s at {sustained['concurrency']} in flight",
                sustained["execs_per_second"],
                floor["execs_per_second"],
                goal("execs_per_second"),
            ],
            [
                f"exec p50 ms, {exec_['burst']['calls']} at once",
                exec_["burst"]["p50_ms"],
                "",
                goal("exec_burst_p50_ms"),
            ],
            [
                "CPU ms per exec (all)",
                cpu["all"]["total"],
                floor["cpu_ms_per_exec"]["all"]["total"],
                goal("exec_cpu_ms"),
            ],
            ["  split ms", _split_text(cpu), _split_text(floor["cpu_ms_per_exec"]), ""],
        ]
    ready = figures.get("ready", {})
    if "create_to_ready_p50_ms" in ready:
        rows.append(
            [
                "create -> READY p50 ms (one)",
                ready["create_to_ready_p50_ms"],
                ready["floor"]["p50_ms"] or ready["floor"]["error"],
                goal("create_to_ready_p50_ms"),
            ]
        )
    fork = figures.get("fork", {})
    if "fork_speedup" in fork:
        rows.append(
            [
                f"fork {fork['count']} vs {fork['count']} x (create+setup) s",
                f"{fork['fork_seconds']} vs {fork['fresh_seconds']} (x{fork['fork_speedup']})",
                f"all at once {fork['fresh_all_at_once_seconds']} "
                f"(x{fork['fork_speedup_vs_all_at_once']})",
                goal("fork_speedup"),
            ]
        )
    return rows


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
    cpu = result["cpu_ms_per_lifecycle"]
    rows.append(["CPU ms per lifecycle (all)", cpu["all"]["total"], goal("cpu_ms_per_lifecycle")])
    rows.append(["  split ms", _split_text(cpu), ""])
    rows.append(["  whole host ms (others' load too)", cpu["host"]["total"], ""])
    print_table(["metric", "value", "target at 1000x4"], rows, out)
    figures = _figure_rows(result, goal)
    if figures:
        out.write("\n")
        print_table(["figure", "orchard", "floor (same run)", "target"], figures, out)
    curve = result.get("curve", [])
    if len(curve) > 1:
        out.write("\n")
        print_table(
            ["sandboxes", "wall s", "success", "ready p50 ms", "exec p50 ms", "CPU ms/lifecycle"],
            [
                [
                    entry["sandboxes"],
                    entry["wall_seconds"],
                    entry["success_rate"],
                    entry["ready_p50_ms"],
                    entry["exec_p50_ms"],
                    entry["cpu_ms_per_lifecycle"]["all"]["total"],
                ]
                for entry in curve
            ],
            out,
        )
    for name, path in result.get("profiles", {}).items():
        out.write(f"profile of {name}: {path} (beside the JSON)\n")
    if result["concurrency_note"]:
        out.write(f"\nnote: {result['concurrency_note']}\n")
    for note in result["notes"]:
        out.write(f"note: {note}\n")
