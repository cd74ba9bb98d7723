"""Benchmark ScoreTests end to end against running the same tests straight on the host.

    .venv/bin/python bench/reward_bench.py [--rounds 4] [--concurrency 4]

Starts a private embedded etcd, ``orchard-env`` (local runtime, needs root; ``make
inagent-binary`` first) and ``orchard-reward`` as processes, builds the in-repo SWE tasks, and
scores each task's gold patch ``--rounds`` times through ScoreTests (a sandbox created from the
task's image per call, patches, pytest with JUnit, judged, deleted), one call at a time and then
``--concurrency`` at once. Baseline, in the same run: the same patches and test command on a
fresh clone of each repository on the host, no sandbox and no RPC. Writes
``bench/results/reward.json`` and prints a table. Exits 1 when a gold patch did not score +1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from orchard.reward.sandbox_tests import JUNIT_ENV
from orchard.reward.swe_instances import SweInstance
from orchard.reward.swe_tasks import build_instances
from orchard.reward.v1 import reward_service_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results" / "reward.json"
REWARD = str(Path(sys.executable).parent / "orchard-reward")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _baseline(instance: SweInstance, scratch: Path) -> float:
    """Clone, apply gold and test patches, run the test command: seconds."""
    started = time.perf_counter()
    target = scratch / f"{instance.instance_id}-{secrets.token_hex(3)}"
    subprocess.run(
        ["git", "clone", "-q", instance.repo_path, str(target)], check=True, capture_output=True
    )
    for patch in (instance.patch, instance.test_patch):
        subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=target, check=True)
    junit = target / "report.xml"
    done = subprocess.run(
        instance.test_command, shell=True, cwd=target, capture_output=True, text=True,
        env={**os.environ, JUNIT_ENV: str(junit)}, check=False, timeout=300,
    )  # fmt: skip
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"baseline run of {instance.instance_id} failed:\n{done.stdout}")
    shutil.rmtree(target)
    return elapsed


async def _score(
    stub: reward_service_pb2_grpc.RewardServiceStub, instance: SweInstance
) -> tuple[float, float]:
    request = instance.score_request(instance.patch)
    started = time.perf_counter()
    reply = await stub.ScoreTests(request, timeout=300)
    return time.perf_counter() - started, reply.reward.value


async def _through_service(
    address: str, instances: list[SweInstance], rounds: int, concurrency: int
) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reward_service_pb2_grpc.RewardServiceStub(channel)
        await _score(stub, instances[0])  # warm: first sandbox, first imports
        sequential = [await _score(stub, i) for _ in range(rounds) for i in instances]
        gate = asyncio.Semaphore(concurrency)

        async def one(instance: SweInstance) -> tuple[float, float]:
            async with gate:
                return await _score(stub, instance)

        started = time.perf_counter()
        parallel = await asyncio.gather(*(one(i) for _ in range(rounds) for i in instances))
        parallel_wall = time.perf_counter() - started
    return {
        "sequential": sequential,
        "parallel": list(parallel),
        "parallel_wall_seconds": parallel_wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="gold scorings per task")
    parser.add_argument("--concurrency", type=int, default=4, help="ScoreTests calls at once")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("reward_bench: the local runtime needs root", file=sys.stderr)
        return 1
    from orchard.sdk.cli.host_probe import remove_cgroup_parent  # noqa: PLC0415
    from orchard.sdk.cli.stack import LocalStack  # noqa: PLC0415

    scratch = Path(tempfile.mkdtemp(prefix="orchard-reward-bench-"))
    tag = secrets.token_hex(3)
    cgroup_parent, run_dir = f"orchard-reward-bench-{tag}", f"/run/orc-rb-{tag}"
    token = secrets.token_urlsafe(16)
    stack = LocalStack(
        scratch / "env",
        listen=f"127.0.0.1:{_free_port()}",
        token=token,
        runtime={"cgroup_parent": cgroup_parent, "run_dir": run_dir},
    )
    process: subprocess.Popen[bytes] | None = None
    try:
        instances = build_instances(scratch / "repos")
        baseline = [_baseline(i, scratch) for _ in range(args.rounds) for i in instances]
        stack.start()
        address = f"127.0.0.1:{_free_port()}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
        env["ORCHARD_TOKEN"] = token
        log = (scratch / "reward.log").open("ab")
        process = subprocess.Popen(
            [REWARD, "--listen", address, "--env", stack.listen, "--log-level", "WARNING"],
            stderr=log, env=env,
        )  # fmt: skip
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 30
            while True:
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("orchard-reward did not serve")
                time.sleep(0.05)
        measured = asyncio.run(_through_service(address, instances, args.rounds, args.concurrency))
    finally:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(30)
        stack.stop()
        remove_cgroup_parent(cgroup_parent)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)

    sequential = [seconds for seconds, _ in measured["sequential"]]
    parallel = [seconds for seconds, _ in measured["parallel"]]
    values = [value for _, value in measured["sequential"] + measured["parallel"]]
    resolved = sum(value == 1.0 for value in values)
    result = {
        "tasks": len(instances),
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "score_tests_p50_ms": statistics.median(sequential) * 1000,
        "score_tests_p90_ms": _quantile(sequential, 0.9) * 1000,
        "score_tests_concurrent_p50_ms": statistics.median(parallel) * 1000,
        "concurrent_wall_seconds": measured["parallel_wall_seconds"],
        "concurrent_scorings_per_second": len(parallel) / measured["parallel_wall_seconds"],
        "baseline_host_p50_ms": statistics.median(baseline) * 1000,
        "baseline_host_p90_ms": _quantile(baseline, 0.9) * 1000,
        "overhead_vs_baseline": statistics.median(sequential) / statistics.median(baseline),
        "gold_resolved": resolved,
        "gold_scored": len(values),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    rows = [
        ("ScoreTests, one at a time (p50 / p90)",
         f"{result['score_tests_p50_ms']:.0f} / {result['score_tests_p90_ms']:.0f} ms"),
        (f"ScoreTests, {args.concurrency} at once (p50)",
         f"{result['score_tests_concurrent_p50_ms']:.0f} ms"),
        (f"  throughput at {args.concurrency} at once",
         f"{result['concurrent_scorings_per_second']:.2f} scorings/s"),
        ("baseline: clone + patches + pytest on the host (p50 / p90)",
         f"{result['baseline_host_p50_ms']:.0f} / {result['baseline_host_p90_ms']:.0f} ms"),
        ("ScoreTests p50 / baseline p50", f"{result['overhead_vs_baseline']:.2f}x"),
        ("gold patches scored +1", f"{resolved} / {len(values)}"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    print(f"reward bench: {len(instances)} tasks x {args.rounds} rounds -> {RESULTS}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    return 0 if resolved == len(values) else 1


if __name__ == "__main__":
    sys.exit(main())
