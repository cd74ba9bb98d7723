"""Benchmark the in-sandbox agent: exec overhead, start time, idle memory, bundle size.

    .venv/bin/python bench/inagent_bench.py [--calls 500] [--starts 15] [--bundle PATH]

Measures, in one run on this machine:

- exec round trip of `true` over gRPC (Unix socket and TCP loopback), p50/p99, beside
  `subprocess.run(['true'])` in this process; the overhead is the difference of the p50s;
- the agent's own CPU per Exec of `true` (from /proc/PID/stat, rounds interleaved with rounds
  of GetAgentInfo, the cost of a bare gRPC call to the same agent), and its commands' CPU;
- start time from exec to health SERVING, bundled executable and Python entry point;
- idle resident memory (VmRSS) and proportional memory (Pss) of the agent after some calls;
- the bundle's size on disk.

Writes bench/results/inagent.json and prints a table with each target and pass/miss. Uses the
bundle at services/inagent/dist/orchard-inagent/ when it is built, else measures the Python
entry point only and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchard.inagent.v1 import inagent_service_pb2, inagent_service_pb2_grpc
from orchard.types.v1 import exec_pb2

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BUNDLE = ROOT / "services" / "inagent" / "dist" / "orchard-inagent" / "orchard-inagent"
RESULTS = ROOT / "bench" / "results" / "inagent.json"

TARGET_OVERHEAD_MS = 1.0
TARGET_START_MS = 300.0
TARGET_IDLE_RSS_MB = 30.0
TARGET_AGENT_CPU_MS = 0.5
START_TIMEOUT_S = 20.0


def python_entry() -> list[str]:
    """The non-bundled agent: the console script next to this interpreter, else `-c main()`."""
    script = Path(sys.executable).parent / "orchard-inagent"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from orchard.inagent.main import main; main()"]


class Progress:
    """One status line on stderr, rewritten in place; quiet when stderr is not a terminal."""

    def __init__(self, label: str, total: int) -> None:
        self.label = label
        self.total = total
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def update(self, done: int) -> None:
        now = time.monotonic()
        if done < self.total and now - self.last < 0.2:
            return
        self.last = now
        line = f"  {self.label}: {done}/{self.total}"
        if self.tty:
            sys.stderr.write(f"\r{line}\x1b[K")
            if done >= self.total:
                sys.stderr.write("\n")
        elif done >= self.total or done == 0:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


@dataclass(frozen=True)
class Latency:
    p50_ms: float
    p99_ms: float
    mean_ms: float
    samples: int

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Latency:
        ordered = sorted(seconds)
        p99_index = min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))
        return cls(
            p50_ms=statistics.median(ordered) * 1e3,
            p99_ms=ordered[p99_index] * 1e3,
            mean_ms=statistics.fmean(ordered) * 1e3,
            samples=len(ordered),
        )


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def health_serving(target: str, timeout_s: float = 0.5) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def unix_socket_accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


class Agent:
    """One agent process serving on `listen`; stopped with SIGTERM, killed if it lingers."""

    def __init__(self, argv: Sequence[str], listen: str, log_path: Path) -> None:
        self.listen = listen
        self.log_path = log_path
        self.argv = [*argv, "--listen", listen]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start and wait for health SERVING; returns seconds from exec to SERVING."""
        with self.log_path.open("ab") as log:
            started = time.perf_counter()
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        unix_path = self.listen.removeprefix("unix:") if self.listen.startswith("unix:") else None
        deadline = started + START_TIMEOUT_S
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.argv[0]} exited {self.process.returncode}; log:\n{self.log_tail()}"
                )
            # A connect() probe is cheap; gRPC's own reconnect backoff would distort the time.
            ready = unix_socket_accepts(unix_path) if unix_path else True
            if ready and health_serving(self.listen):
                return time.perf_counter() - started
            time.sleep(0.001)
        self.stop()
        raise RuntimeError(f"{self.argv[0]} not SERVING within {START_TIMEOUT_S} s")

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("the agent was not started")
        return self.process.pid

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-2000:]
        return ""

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextlib.contextmanager
def running_agent(argv: Sequence[str], listen: str, workdir: Path) -> Iterator[Agent]:
    agent = Agent(argv, listen, workdir / "agent.log")
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()


def time_calls(call: Callable[[], object], count: int, label: str) -> Latency:
    progress = Progress(label, count)
    samples: list[float] = []
    for index in range(count):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
        progress.update(index + 1)
    return Latency.of(samples)


def exec_round_trip(target: str, calls: int, warmup: int, label: str) -> Latency:
    request = inagent_service_pb2.ExecRequest(command=exec_pb2.Command(argv=["true"]))
    with grpc.insecure_channel(target) as channel:
        stub = inagent_service_pb2_grpc.AgentServiceStub(channel)

        def call() -> None:
            reply = stub.Exec(request, timeout=10)
            if reply.result.status.exit_code != 0:
                raise RuntimeError(f"`true` exited {reply.result.status}")

        for _ in range(warmup):
            call()
        return time_calls(call, calls, label)


def _cpu_ms(pid: int, children: bool = False) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    first = 13 if children else 11  # cutime, cstime / utime, stime (0-based after the name)
    return (int(fields[first]) + int(fields[first + 1])) * 1e3 / os.sysconf("SC_CLK_TCK")


def agent_cpu(target: str, pid: int, calls: int, rounds: int) -> dict[str, Any]:
    """The agent's CPU per call of Exec `true` and of GetAgentInfo, in interleaved rounds.

    /proc counts in clock ticks (10 ms): a round of ``calls`` calls keeps that error small.
    """
    exec_request = inagent_service_pb2.ExecRequest(command=exec_pb2.Command(argv=["true"]))
    info_request = inagent_service_pb2.GetAgentInfoRequest()
    per: dict[str, list[float]] = {"exec": [], "info": [], "commands": []}
    with grpc.insecure_channel(target) as channel:
        stub = inagent_service_pb2_grpc.AgentServiceStub(channel)
        for _ in range(50):
            stub.Exec(exec_request, timeout=10)
        progress = Progress("agent CPU rounds", rounds)
        for index in range(rounds):
            before, children = _cpu_ms(pid), _cpu_ms(pid, children=True)
            for _ in range(calls):
                stub.Exec(exec_request, timeout=10)
            per["exec"].append((_cpu_ms(pid) - before) / calls)
            per["commands"].append((_cpu_ms(pid, children=True) - children) / calls)
            before = _cpu_ms(pid)
            for _ in range(calls):
                stub.GetAgentInfo(info_request, timeout=10)
            per["info"].append((_cpu_ms(pid) - before) / calls)
            progress.update(index + 1)
    return {
        "calls_per_round": calls,
        "rounds": rounds,
        "exec_ms": statistics.median(per["exec"]),
        "get_agent_info_ms": statistics.median(per["info"]),
        "commands_ms": statistics.median(per["commands"]),
        "note": "medians over rounds; the agent's own user+system CPU per call, the "
        "commands' (`true`) CPU apart; GetAgentInfo is the gRPC floor of a call to the agent",
    }


def subprocess_true(calls: int, warmup: int) -> Latency:
    true = shutil.which("true") or "true"

    def call() -> None:
        subprocess.run([true], check=True)

    for _ in range(warmup):
        call()
    return time_calls(call, calls, "subprocess.run(['true'])")


def start_times(argv: Sequence[str], runs: int, workdir: Path, label: str) -> dict[str, Any]:
    progress = Progress(label, runs)
    samples: list[float] = []
    for index in range(runs):
        listen = f"unix:{workdir / f'start-{index}.sock'}"
        agent = Agent(argv, listen, workdir / "start.log")
        try:
            samples.append(agent.start())
        finally:
            agent.stop()
        progress.update(index + 1)
    return {
        "median_ms": statistics.median(samples) * 1e3,
        "min_ms": min(samples) * 1e3,
        "max_ms": max(samples) * 1e3,
        "runs": runs,
    }


def memory_of(pid: int) -> dict[str, float | None]:
    rss_kb: float | None = None
    pss_kb: float | None = None
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss_kb = float(line.split()[1])
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss_kb = float(line.split()[1])
    return {
        "rss_mb": None if rss_kb is None else rss_kb / 1024,
        "pss_mb": None if pss_kb is None else pss_kb / 1024,
    }


def idle_memory(argv: Sequence[str], workdir: Path, idle_s: float) -> dict[str, float | None]:
    """Memory of one idle agent; then its PSS while a second agent runs from the same files.

    The second figure is what each further sandbox costs when, as with the local runtime,
    every sandbox maps one copy of the bundle (file pages are shared, PSS splits them).
    """
    first = f"unix:{workdir / 'idle.sock'}"
    second = f"unix:{workdir / 'idle-second.sock'}"
    with running_agent(argv, first, workdir) as agent:
        exec_round_trip(first, calls=20, warmup=0, label="calls before idle")
        time.sleep(idle_s)
        alone = memory_of(agent.pid)
        with running_agent(argv, second, workdir):
            exec_round_trip(second, calls=20, warmup=0, label="calls before idle")
            time.sleep(idle_s)
            shared = memory_of(agent.pid)
    return {**alone, "pss_mb_two_agents": shared["pss_mb"]}


def tree_size(root: Path) -> int:
    return sum(path.lstat().st_size for path in root.rglob("*") if path.is_file())


def verdict(value: float | None, target: float) -> str:
    if value is None:
        return "n/a"
    return "pass" if value <= target else "miss"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    bundle: Path = args.bundle
    bundled = bundle.is_file() and os.access(bundle, os.X_OK)
    python_argv = python_entry()
    agent_argv = [str(bundle)] if bundled else python_argv
    results: dict[str, Any] = {
        "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "bundle": {"path": str(bundle), "built": bundled},
        "agent_measured": "bundle" if bundled else "python entry point",
        "targets": {
            "exec_overhead_p50_ms": TARGET_OVERHEAD_MS,
            "start_ms": TARGET_START_MS,
            "idle_rss_mb": TARGET_IDLE_RSS_MB,
        },
    }
    if bundled:
        results["bundle"]["size_bytes"] = tree_size(bundle.parent)
        results["bundle"]["launcher_bytes"] = bundle.stat().st_size
    else:
        print(f"bundle not built ({bundle}): measuring the Python entry point only", flush=True)

    with tempfile.TemporaryDirectory(prefix="inagent-bench-") as scratch:
        workdir = Path(scratch)
        print("exec round trip", flush=True)
        baseline = subprocess_true(args.calls, args.warmup)
        unix_target = f"unix:{workdir / 'exec.sock'}"
        with running_agent(agent_argv, unix_target, workdir) as agent:
            over_unix = exec_round_trip(unix_target, args.calls, args.warmup, "gRPC Exec (unix)")
            print("agent CPU per exec", flush=True)
            cpu = agent_cpu(unix_target, agent.pid, args.cpu_calls, args.cpu_rounds)
        tcp_target = f"127.0.0.1:{free_tcp_port()}"
        with running_agent(agent_argv, tcp_target, workdir):
            over_tcp = exec_round_trip(tcp_target, args.calls, args.warmup, "gRPC Exec (tcp)")
        overhead = over_unix.p50_ms - baseline.p50_ms
        results["exec"] = {
            "command": ["true"],
            "subprocess_run": baseline.__dict__,
            "grpc_unix": over_unix.__dict__,
            "grpc_tcp": over_tcp.__dict__,
            "overhead_p50_ms_unix": overhead,
            "overhead_p50_ms_tcp": over_tcp.p50_ms - baseline.p50_ms,
            "target_overhead_p50_ms": TARGET_OVERHEAD_MS,
            "verdict": verdict(overhead, TARGET_OVERHEAD_MS),
            "agent_cpu": {**cpu, "target_exec_ms": TARGET_AGENT_CPU_MS},
        }

        print("start to health SERVING", flush=True)
        start: dict[str, Any] = {"target_ms": TARGET_START_MS}
        if bundled:
            start["bundle"] = start_times([str(bundle)], args.starts, workdir, "bundle starts")
        start["python"] = start_times(python_argv, args.starts, workdir, "python starts")
        measured = start.get("bundle", start["python"])
        start["verdict"] = verdict(measured["median_ms"], TARGET_START_MS)
        results["start"] = start

        print("idle memory", flush=True)
        memory: dict[str, Any] = {
            "target_rss_mb": TARGET_IDLE_RSS_MB,
            "idle_s": args.idle_s,
            "note": (
                "python PSS shares libpython and extension pages with this benchmark process; "
                "pss_mb_two_agents: PSS while a second agent maps the same files"
            ),
        }
        if bundled:
            memory["bundle"] = idle_memory([str(bundle)], workdir, args.idle_s)
        memory["python"] = idle_memory(python_argv, workdir, args.idle_s)
        memory["verdict"] = verdict(
            memory.get("bundle", memory["python"])["rss_mb"], TARGET_IDLE_RSS_MB
        )
        results["memory"] = memory
    return results


def format_table(results: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str, str]] = []
    exec_ = results["exec"]
    rows.append(
        (
            "subprocess.run(['true'])",
            f"p50 {exec_['subprocess_run']['p50_ms']:.2f} ms, "
            f"p99 {exec_['subprocess_run']['p99_ms']:.2f} ms",
            "",
            "",
        )
    )
    for key, label in (("grpc_unix", "Exec `true`, unix socket"), ("grpc_tcp", "Exec `true`, tcp")):
        rows.append(
            (
                label,
                f"p50 {exec_[key]['p50_ms']:.2f} ms, p99 {exec_[key]['p99_ms']:.2f} ms",
                "",
                "",
            )
        )
    rows.append(
        (
            "exec overhead (p50, unix)",
            f"{exec_['overhead_p50_ms_unix']:.2f} ms (tcp {exec_['overhead_p50_ms_tcp']:.2f} ms)",
            f"<= {TARGET_OVERHEAD_MS:g} ms",
            exec_["verdict"],
        )
    )
    cpu = exec_["agent_cpu"]
    rows.append(
        (
            "agent CPU per Exec `true`",
            f"{cpu['exec_ms']:.3f} ms (GetAgentInfo {cpu['get_agent_info_ms']:.3f} ms, "
            f"`true` itself {cpu['commands_ms']:.3f} ms)",
            f"<= {TARGET_AGENT_CPU_MS:g} ms",
            verdict(cpu["exec_ms"], TARGET_AGENT_CPU_MS),
        )
    )
    start = results["start"]
    for key in ("bundle", "python"):
        if key in start:
            value = start[key]["median_ms"]
            is_measured = key == ("bundle" if "bundle" in start else "python")
            rows.append(
                (
                    f"start to SERVING, {key} (median)",
                    f"{value:.0f} ms",
                    f"<= {TARGET_START_MS:g} ms" if is_measured else "",
                    verdict(value, TARGET_START_MS) if is_measured else "",
                )
            )
    memory = results["memory"]
    for key in ("bundle", "python"):
        if key in memory:
            value = memory[key]["rss_mb"]
            pss = memory[key]["pss_mb"]
            pss_two = memory[key]["pss_mb_two_agents"]
            is_measured = key == ("bundle" if "bundle" in memory else "python")
            rows.append(
                (
                    f"idle memory, {key}",
                    f"RSS {value:.1f} MB"
                    + ("" if pss is None else f", PSS {pss:.1f} MB")
                    + ("" if pss_two is None else f" ({pss_two:.1f} MB beside a 2nd)"),
                    f"RSS <= {TARGET_IDLE_RSS_MB:g} MB" if is_measured else "",
                    verdict(value, TARGET_IDLE_RSS_MB) if is_measured else "",
                )
            )
    bundle = results["bundle"]
    rows.append(
        (
            "bundle size on disk",
            f"{bundle['size_bytes'] / 2**20:.1f} MiB" if bundle["built"] else "not built",
            "",
            "",
        )
    )
    header = ("measure", "value", "target", "")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * width for width in widths))
    lines += [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=500, help="timed Exec calls per transport")
    parser.add_argument("--warmup", type=int, default=50, help="untimed calls before timing")
    parser.add_argument("--cpu-calls", type=int, default=400, help="calls per agent CPU round")
    parser.add_argument("--cpu-rounds", type=int, default=6, help="agent CPU rounds")
    parser.add_argument("--starts", type=int, default=15, help="starts timed per executable")
    parser.add_argument("--idle-s", type=float, default=2.0, help="idle time before memory")
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE, help="bundle launcher")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    results = measure(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print()
    print(format_table(results))
    print(f"\nwritten to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
