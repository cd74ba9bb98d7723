"""Benchmark unmodified third-party agent programs running inside sandboxes.

    .venv/bin/python bench/harness_bench.py [--rollouts 2] [--concurrency 2]
        [--harnesses program:openclaw,program:codex] [--skip-floor]

Needs root: it starts a private etcd and orchard-env with the local runtime, as `orchard up`
does (`on_local_env` of rollout_bench.py), and the harness cache `make harnesses` builds
(`.cache/harnesses`, or `$ORCHARD_HARNESS_CACHE`).

For each program harness (`program:openclaw`, `program:claude-code`, `program:codex`,
`program:hermes`, as `builtin_programs.program_harness` defines them) it runs R rollouts, C at a
time, of one tiny task (write a given line to /srv/work/out.txt; checked with `test "$(cat
/srv/work/out.txt)" = LINE`) through the rollout runner and the real environment service. The
model is a scripted teacher (`ScriptedEngine`) behind the capture proxy, listening on this
host's address: its solution is one shell step, which the teacher puts in the harness's own
shell tool, then a final answer. Each rollout runs in a sandbox of its own.

Reported per harness:
  - ok: rollouts that completed with reward 1 (the check passed);
  - wall per rollout, median and max: the runner's whole rollout (sandbox create, setup, the
    program's run, the check, the delete), seconds;
  - runs/min: rollouts / wall time of the whole batch x 60, at concurrency C;
  - calls per rollout: model calls captured by the proxy (`CallRecord`s), mean;
  - first prompt tokens: prompt tokens of the first captured call (the program's own system
    prompt and tool schemas, in the tokenizer's chat template), median over rollouts;
  - start s: from the program's launch in the sandbox (its tool event's start) to its first
    model call reaching the proxy, median: the program's own start-up time;
  - program s: the program's run in the sandbox (its tool event's latency), median;
  - peak MiB: the largest PSS of one sandbox while its program runs: every 0.25 s, the PSS
    (/proc/<pid>/smaps_rollup) summed over the processes whose /proc/<pid>/cgroup names the
    sandbox's id (the local runtime's cgroup of a sandbox is named after it), the max over
    the samples inside the program's run, then the max over rollouts; sandboxes per GiB is
    1024 / that.
A failed rollout is reported with its failure and the tail of its tool event output.

As the machine's floor, the same task through the built-in `bash` tool loop (the harness runs
in this process; only its commands run in the sandbox; its start s and program s do not apply,
and its peak MiB is over the sandbox's whole life, the sandbox's own agent and shell);
`--skip-floor` leaves it out.

Writes bench/results/harness.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.rollout_bench import on_local_env
else:  # bench scripts run with bench/ on sys.path
    from rollout_bench import on_local_env

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "harness.json"

PROGRAMS = ("program:openclaw", "program:claude-code", "program:codex", "program:hermes")
FLOOR = "builtin:bash"
LINE = "orchard harness bench"
INSTRUCTION = f"Write the line '{LINE}' into the file /srv/work/out.txt."
SAMPLE_S = 0.25
SANDBOX_ID = re.compile(r"sbx-[0-9a-f]{12}")
"""How the environment service names sandboxes; the local runtime names their cgroups so."""


def harness_cache_path() -> Path:
    return Path(os.environ.get("ORCHARD_HARNESS_CACHE") or ROOT / ".cache" / "harnesses")


class PssSampler:
    """Every `SAMPLE_S`, the PSS of every sandbox's processes summed, by sandbox id, kept as
    (time, KiB) samples. A thread of its own: the event loop is busy with the rollouts."""

    def __init__(self) -> None:
        self.samples: dict[str, list[tuple[float, int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pss-sampler", daemon=True)

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.time()
            for sandbox, kib in sandbox_pss_kib().items():
                self.samples.setdefault(sandbox, []).append((started, kib))
            self._stop.wait(max(0.0, SAMPLE_S - (time.time() - started)))

    def peak_mib(self, sandbox: str, start: float, end: float) -> float | None:
        """The largest sample of `sandbox` within [start, end] (epoch seconds), in MiB."""
        inside = [kib for t, kib in self.samples.get(sandbox, []) if start <= t <= end]
        return max(inside) / 1024 if inside else None


def sandbox_pss_kib() -> dict[str, int]:
    """Now, by sandbox id: the PSS of its processes summed (KiB), read on the host (inside, a
    sandbox's root cannot read the smaps of processes running as another user)."""
    totals: dict[str, int] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cgroup = Path(f"/proc/{pid}/cgroup").read_text()
            found = SANDBOX_ID.search(cgroup)
            if found is None:
                continue
            pss = _pss_kib(Path(f"/proc/{pid}/smaps_rollup").read_text())
        except OSError:  # the process ended meanwhile
            continue
        totals[found.group(0)] = totals.get(found.group(0), 0) + pss
    return totals


def _pss_kib(smaps_rollup: str) -> int:
    for line in smaps_rollup.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def script_and_task() -> tuple[Any, Any]:
    from orchard.rollout.scripted_policy import PolicyScript  # noqa: PLC0415
    from orchard.rollout.tasks import TaskSpec  # noqa: PLC0415

    script = PolicyScript.from_json(
        {
            "plans": [
                {
                    "match": "into the file /srv/work/out.txt",
                    "solve_rate": 1.0,
                    "solution": [
                        # The abstract shell step; the teacher puts it in each harness's own
                        # shell tool (exec, Bash, shell, terminal, bash).
                        {
                            "thought": "I will write the line.",
                            "tool": "shell",
                            "arguments": {"command": f"printf '%s' '{LINE}' > /srv/work/out.txt"},
                        },
                        {"thought": "The line is written."},
                    ],
                    "failure": [{"thought": "I cannot."}],
                }
            ]
        }
    )
    task = TaskSpec.from_settings(
        "out-line",
        INSTRUCTION,
        {
            "check": {"command": f"test \"$(cat /srv/work/out.txt)\" = '{LINE}'"},
            "workdir": "/srv/work",
            "setup": ["mkdir -p /srv/work"],
        },
    )
    return script, task


def summarize(
    name: str, results: list[Any], batch_s: float, walls: list[float], sampler: PssSampler
) -> dict[str, Any]:
    from orchard.rollout.results import RolloutStatus  # noqa: PLC0415

    ok = 0
    calls: list[int] = []
    first_prompt: list[int] = []
    start_s: list[float] = []
    program_s: list[float] = []
    peaks: list[float] = []
    failures: list[dict[str, Any]] = []
    for result in results:
        record = result.payload
        if result.status is RolloutStatus.COMPLETED and result.reward == 1.0:
            ok += 1
        else:
            failures.append(
                {
                    "status": result.status.name,
                    "reward": result.reward,
                    "failure": str(record.failure) if record.failure is not None else None,
                    "tool_output_tail": [e.output[-1500:] for e in record.tool_events][-2:],
                }
            )
        calls.append(len(record.calls))
        ordered = sorted(record.calls, key=lambda c: c.started_at)
        if ordered:
            first_prompt.append(len(ordered[0].prompt_token_ids))
        events = [e for e in record.tool_events if e.tool == name]
        if events:  # a program harness: one event, the program's whole run
            event = events[0]
            program_s.append(event.latency_s)
            if ordered:
                start_s.append(ordered[0].started_at - event.started_at)
            window = (event.started_at, event.started_at + event.latency_s)
        elif record.tool_events:  # the floor: its commands are too short to sample, so the
            window = (0.0, float("inf"))  # sandbox's whole life (its agent and shell)
        else:
            continue
        sandbox = record.tool_events[0].sandbox_id
        peak = sampler.peak_mib(sandbox, *window)
        if peak is not None:
            peaks.append(peak)
    peak_mib = max(peaks) if peaks else None
    return {
        "harness": name,
        "rollouts": len(results),
        "ok": ok,
        "batch_wall_s": batch_s,
        "wall_s_median": statistics.median(walls),
        "wall_s_max": max(walls),
        "runs_per_min": len(results) / batch_s * 60,
        "calls_per_rollout": statistics.fmean(calls),
        "first_prompt_tokens": int(statistics.median(first_prompt)) if first_prompt else None,
        "start_s_median": statistics.median(start_s) if start_s else None,
        "program_s_median": statistics.median(program_s) if program_s else None,
        "peak_pss_mib": peak_mib,
        "peak_pss_mib_per_rollout": peaks,
        "sandboxes_per_gib": 1024 / peak_mib if peak_mib else None,
        "failures": failures,
    }


async def bench(
    endpoint: str, token: str, *, names: list[str], rollouts: int, concurrency: int, floor: bool
) -> dict[str, Any]:
    from orchard.lm.tokenizer import build_tokenizer  # noqa: PLC0415
    from orchard.rollout.budgets import LayeredRetries, LayerRetry, RolloutBudget  # noqa: PLC0415
    from orchard.rollout.engines.scripted import ScriptedEngine  # noqa: PLC0415
    from orchard.rollout.harnesses.bash_react import bash_react_harness  # noqa: PLC0415
    from orchard.rollout.harnesses.builtin_programs import program_harness  # noqa: PLC0415
    from orchard.rollout.harnesses.sandboxed import HarnessCache, host_address  # noqa: PLC0415
    from orchard.rollout.harnesses.tool_loop import ModelEndpoint  # noqa: PLC0415
    from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig  # noqa: PLC0415
    from orchard.rollout.results import GroupKey  # noqa: PLC0415
    from orchard.rollout.runner import ProxyCapture, RolloutRunner  # noqa: PLC0415
    from orchard.sdk import AsyncSandboxClient  # noqa: PLC0415

    host = host_address()
    if host.startswith("127."):
        raise SystemExit("this host has no IPv4 address besides loopback for sandboxes to reach")
    cache = HarnessCache(str(harness_cache_path()))
    harnesses: dict[str, Any] = {n: program_harness(n, cache, wall_clock_s=300) for n in names}
    if floor:
        harnesses[FLOOR] = bash_react_harness()
    script, task = script_and_task()
    engine = ScriptedEngine(script, build_tokenizer(), seed=0)
    rows: list[dict[str, Any]] = []
    async with (
        CaptureProxy(engine, CaptureProxyConfig(host=host, settle_quiet_s=0.2)) as proxy,
        AsyncSandboxClient(endpoint, token=token) as sandboxes,
    ):
        runner = RolloutRunner(
            sandboxes=sandboxes,
            endpoint=ModelEndpoint(base_url="unused", model="teacher", max_tokens_per_call=256),
            harnesses=harnesses,
            tasks={task.id: task},
            budget=RolloutBudget(max_duration_s=360),
            retries=LayeredRetries(
                sandbox_create=LayerRetry(attempts=2, timeout_s=60, initial_backoff_s=0.01),
                reward=LayerRetry(attempts=1, timeout_s=60),
                create_spread_s=0.0,
            ),
            capture=ProxyCapture(proxy),
            seed=0,
            keep_records=False,
        )
        gate = asyncio.Semaphore(concurrency)
        with PssSampler() as sampler:
            for name in harnesses:
                key = GroupKey(task.id, name)
                walls: list[float] = []

                async def one(index: int, key: GroupKey = key, walls: list[float] = walls) -> Any:
                    async with gate:
                        started = time.perf_counter()
                        result = await runner(key, index)
                        walls.append(time.perf_counter() - started)
                        return result

                print(f"  {name}: {rollouts} rollouts ...", file=sys.stderr, flush=True)
                started = time.perf_counter()
                results = await asyncio.gather(*(one(i) for i in range(rollouts)))
                batch_s = time.perf_counter() - started
                rows.append(summarize(name, list(results), batch_s, walls, sampler))
    return {"harnesses": rows}


def versions() -> dict[str, str]:
    try:
        manifest = json.loads((harness_cache_path() / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return {
        name: str(entry.get("version", ""))
        for name, entry in manifest.get("harnesses", {}).items()
        if isinstance(entry, dict)
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=2, help="rollouts per harness")
    parser.add_argument("--concurrency", type=int, default=2, help="rollouts at a time")
    parser.add_argument(
        "--harnesses",
        default=",".join(PROGRAMS),
        help=f"comma-separated subset of {', '.join(PROGRAMS)}",
    )
    parser.add_argument("--skip-floor", action="store_true", help=f"leave out the {FLOOR} floor")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.harnesses.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        parser.error(f"unknown harness(es) {', '.join(unknown)}; choose from {', '.join(PROGRAMS)}")
    if args.rollouts < 1 or args.concurrency < 1:
        parser.error("--rollouts and --concurrency must be at least 1")
    cache = harness_cache_path()
    if names and not (cache / "manifest.json").is_file():
        print(
            f"no harness cache at {cache}: build it with `make harnesses` "
            "(or point $ORCHARD_HARNESS_CACHE at one)",
            file=sys.stderr,
        )
        return 2

    async def work(endpoint: str, token: str) -> dict[str, Any]:
        return await bench(
            endpoint,
            token,
            names=names,
            rollouts=args.rollouts,
            concurrency=args.concurrency,
            floor=not args.skip_floor,
        )

    measured = on_local_env(work)
    result = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "settings": {
            "rollouts": args.rollouts,
            "concurrency": args.concurrency,
            "sample_s": SAMPLE_S,
            "task": INSTRUCTION,
        },
        "program_versions": versions(),
        **measured,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")

    if "skipped" in measured:
        print(f"Harness bench: skipped ({measured['skipped']})")
        return 0
    print(
        f"Agent programs in sandboxes ({args.rollouts} rollouts, concurrency {args.concurrency}, "
        "scripted teacher behind the capture proxy)"
    )
    print(
        f"  {'harness':<20} {'ok':>5} {'wall p50':>8} {'max':>6} {'runs/min':>8} "
        f"{'calls':>5} {'prompt1':>7} {'start s':>7} {'prog s':>6} {'peak MiB':>8} "
        f"{'sbx/GiB':>7}"
    )
    for row in measured["harnesses"]:
        print(
            f"  {row['harness']:<20} {row['ok']:>2}/{row['rollouts']:<2} "
            f"{row['wall_s_median']:>8.2f} {row['wall_s_max']:>6.2f} "
            f"{row['runs_per_min']:>8.1f} {row['calls_per_rollout']:>5.1f} "
            f"{_fmt(row['first_prompt_tokens'], 'd'):>7} {_fmt(row['start_s_median'], '.2f'):>7} "
            f"{_fmt(row['program_s_median'], '.2f'):>6} {_fmt(row['peak_pss_mib'], '.1f'):>8} "
            f"{_fmt(row['sandboxes_per_gib'], '.1f'):>7}"
        )
    for row in measured["harnesses"]:
        for failure in row["failures"]:
            print(f"  {row['harness']} failed: {failure['status']} {failure['failure']}")
            for output in failure["tool_output_tail"]:
                print("    " + output[-600:].replace("\n", "\n    "))
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
