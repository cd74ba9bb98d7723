"""Compare the local runtime's two agent launches, exec (one agent process per sandbox from the
bundle) and zygote (a fork of one pre-loaded agent), on this host. Needs root and the bundle.

    .venv/bin/python bench/local_launch_bench.py [--sandboxes 20 50] [--rounds 2] [--json FILE]

Per mode and round, alternating the modes so both see the same host load: N sandboxes created
one after another (wall time of each ``create``, which returns once the agent serves), their
memory once idle, then N created at once, then Exec latency through one agent. CPU is the
``cpuacct`` usage of a cgroup holding this process, the zygote, every helper and every sandbox
(cgroup v1; on v2 the same from ``cpu.stat``), so it counts everything a start costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc

from orchard.env.runtime.base import RuntimeSandboxSpec
from orchard.env.runtime.local import LocalRuntime, LocalRuntimeConfig
from orchard.inagent.v1 import inagent_service_pb2 as agent_pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as agent_grpc
from orchard.types.v1 import exec_pb2

CGROUP_V1 = "/sys/fs/cgroup/cpuacct"


class CpuMeter:
    """CPU of this process and every descendant, from a cgroup made for the run."""

    def __init__(self) -> None:
        v1 = os.path.isdir(CGROUP_V1)
        self.dir = f"{CGROUP_V1 if v1 else '/sys/fs/cgroup'}/orchard-launch-bench-{os.getpid()}"
        self.v1 = v1
        os.mkdir(self.dir)
        self.origin = Path(f"/proc/{os.getpid()}/cgroup").read_text()
        Path(self.dir, "cgroup.procs").write_text(str(os.getpid()))

    def seconds(self) -> float:
        if self.v1:
            return int(Path(self.dir, "cpuacct.usage").read_text()) / 1e9
        for line in Path(self.dir, "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec"):
                return int(line.split()[1]) / 1e6
        raise RuntimeError("no usage_usec")

    def close(self) -> None:
        parent = os.path.dirname(self.dir)
        Path(parent, "cgroup.procs").write_text(str(os.getpid()))
        os.rmdir(self.dir)


def memory_kib(pid: int) -> tuple[int, int]:
    """(PSS, USS) of one process in KiB."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        values[key] = int(value.split()[0])
    return values["Pss"], values["Private_Clean"] + values["Private_Dirty"]


def _stat(pid: int) -> list[str]:
    data = Path(f"/proc/{pid}/stat").read_text()
    return data[data.rindex(")") + 2 :].split()


def tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in os.listdir(f"/proc/{current}/task"):
            children = Path(f"/proc/{current}/task/{task}/children").read_text().split()
            todo.extend(int(child) for child in children)
    return found


async def exec_latency(address: str, calls: int) -> list[float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = agent_grpc.AgentServiceStub(channel)
        request = agent_pb.ExecRequest(command=exec_pb2.Command(argv=["true"]))
        await stub.Exec(request, timeout=30)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            await stub.Exec(request, timeout=30)
            times.append(time.perf_counter() - start)
    return times


async def one_round(mode: str, n: int, cpu: CpuMeter, bundle: str) -> dict[str, Any]:
    run_dir = tempfile.mkdtemp(prefix="orc-")
    work = tempfile.mkdtemp(prefix="orchard-launch-bench-")
    config = LocalRuntimeConfig.model_validate(
        {
            "state_dir": f"{work}/state",
            "workspace_dir": f"{work}/sandboxes",
            "run_dir": run_dir,
            "cgroup_parent": f"lb-{uuid.uuid4().hex[:6]}",
            "agent_bundle": bundle,
            "agent_launch": mode,
        }
    )
    runtime = LocalRuntime(config)
    result: dict[str, Any] = {"mode": mode, "sandboxes": n}
    started = time.perf_counter()
    cpu0 = cpu.seconds()
    await runtime.start()  # in zygote mode this starts the zygote
    result["runtime_start_s"] = time.perf_counter() - started
    result["runtime_start_cpu_s"] = cpu.seconds() - cpu0
    zygote = runtime._zygote
    try:
        walls = []
        cpu0 = cpu.seconds()
        for i in range(n):
            started = time.perf_counter()
            await runtime.create(RuntimeSandboxSpec(f"s{i}", "host"))
            walls.append(time.perf_counter() - started)
        result["sequential_cpu_s_per_start"] = (cpu.seconds() - cpu0) / n
        result["sequential_wall_s_median"] = statistics.median(walls)
        await asyncio.sleep(2.0)
        pids = [state.pid for i in range(n) if (state := runtime.store.read(f"s{i}"))]
        sandbox_pids = [p for pid in pids for p in tree(pid)]
        ticks = os.sysconf("SC_CLK_TCK")
        agent_cpu = sum(sum(int(f) for f in _stat(pid)[11:13]) for pid in sandbox_pids) / ticks
        result["agent_cpu_s_per_start"] = agent_cpu / n
        pss, uss = zip(*(memory_kib(pid) for pid in sandbox_pids), strict=True)
        zygote_pss = memory_kib(zygote.pid)[0] if zygote is not None and zygote.pid else 0
        result["pss_mib_per_sandbox"] = (sum(pss) + zygote_pss) / n / 1024
        result["uss_mib_per_sandbox"] = sum(uss) / n / 1024
        result["zygote_pss_mib"] = zygote_pss / 1024
        latencies = await exec_latency(f"unix:{run_dir}/s0/agent.sock", 200)
        latencies.sort()
        result["exec_true_p50_ms"] = latencies[len(latencies) // 2] * 1000
        result["exec_true_p90_ms"] = latencies[int(len(latencies) * 0.9)] * 1000
        for i in range(n):
            await runtime.delete(f"s{i}")
        cpu0 = cpu.seconds()
        started = time.perf_counter()
        await asyncio.gather(
            *(runtime.create(RuntimeSandboxSpec(f"b{i}", "host")) for i in range(n))
        )
        result["burst_wall_s"] = time.perf_counter() - started
        result["burst_cpu_s_per_start"] = (cpu.seconds() - cpu0) / n
        await asyncio.gather(*(runtime.delete(f"b{i}") for i in range(n)))
    finally:
        for sandbox_id in await runtime.list_sandboxes():
            await runtime.delete(sandbox_id)
        await runtime.close()
        runtime.remove_cgroup_parents()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, nargs="+", default=[20, 50])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    from orchard.env.runtime.local.config import default_agent_bundle  # noqa: PLC0415

    bundle = default_agent_bundle()
    cpu = CpuMeter()
    results = []
    try:
        for n in args.sandboxes:
            for _ in range(args.rounds):
                for mode in ("exec", "zygote"):
                    result = await one_round(mode, n, cpu, bundle)
                    print(
                        json.dumps(
                            {
                                k: round(v, 4) if isinstance(v, float) else v
                                for k, v in result.items()
                            }
                        ),
                        flush=True,
                    )
                    results.append(result)
    finally:
        cpu.close()
    return results


def run() -> None:
    args = parse_args()
    results = asyncio.run(main(args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    run()
