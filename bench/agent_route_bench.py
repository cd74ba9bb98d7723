"""Exec of `true` over the two routes, interleaved in one run: through orchard-env, and direct
to the sandbox's agent with a route credential (``AsyncSandboxClient(direct_agent=True)``).

    .venv/bin/python bench/agent_route_bench.py [--rounds 20] [--execs 50] [--json FILE]

Starts a private etcd + orchard-env (local runtime: needs root; ``make inagent-binary`` first),
creates one sandbox, then alternates blocks of ``--execs`` sequential execs (one in flight) on
each route for ``--rounds`` rounds, so both see the same machine load. Prints the single
round-trip p50/p90 per route and the CPU per exec: this client process, orchard-env, and the
sandbox's agent with the commands it ran (its PID 1's own and reaped children's CPU time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchard.sdk import AsyncSandboxClient

if TYPE_CHECKING:
    from bench.bench_stack import private_env_stack
else:  # bench scripts run with bench/ on sys.path
    from bench_stack import private_env_stack

_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int, children: bool = False) -> float:
    """User + system CPU seconds of ``pid`` (and of the children it reaped)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as file:
        fields = file.read().rpartition(")")[2].split()
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICK


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def agent_pid(state_dir: str, sandbox_id: str) -> int:
    with open(os.path.join(state_dir, f"{sandbox_id}.json"), encoding="utf-8") as file:
        return int(json.load(file)["pid"])


PARTS = ("client", "orchard_env", "agent_and_command")


async def measure(
    endpoint: str, token: str, env_pid: int, state_dir: str, args: Any
) -> dict[str, Any]:
    latencies: dict[str, list[float]] = {"orchard-env": [], "direct": []}
    cpu_s: dict[str, dict[str, float]] = {name: dict.fromkeys(PARTS, 0.0) for name in latencies}
    async with (
        AsyncSandboxClient(endpoint, token=token) as via_env,
        AsyncSandboxClient(endpoint, token=token, direct_agent=True) as direct,
        via_env.create(image="host") as sandbox,
    ):
        await sandbox.wait()
        handles = {"orchard-env": sandbox, "direct": await direct.get(sandbox.id)}
        agent = agent_pid(state_dir, sandbox.id)
        for handle in handles.values():  # warm both routes (channels, route, caches)
            for _ in range(20):
                await handle.exec(["true"])
        for _ in range(args.rounds):
            for name, handle in handles.items():
                before = (self_cpu_s(), process_cpu_s(env_pid), process_cpu_s(agent, True))
                for _ in range(args.execs):
                    started = time.perf_counter()
                    await handle.exec(["true"])
                    latencies[name].append(time.perf_counter() - started)
                after = (self_cpu_s(), process_cpu_s(env_pid), process_cpu_s(agent, True))
                for part, b, a in zip(PARTS, before, after, strict=True):
                    cpu_s[name][part] += a - b
        assert direct.routes is not None
        fallbacks = direct.routes.fallbacks
    result: dict[str, Any] = {"rounds": args.rounds, "execs_per_block": args.execs}
    for name, samples in latencies.items():
        samples.sort()
        count = len(samples)
        cpu = {part: seconds / count * 1e3 for part, seconds in cpu_s[name].items()}
        result[name] = {
            "execs": count,
            "p50_ms": statistics.median(samples) * 1e3,
            "p90_ms": samples[int(0.9 * (count - 1))] * 1e3,
            "cpu_ms_per_exec": {**cpu, "total": sum(cpu.values())},
        }
    result["direct"]["fallbacks"] = fallbacks
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--execs", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (the local runtime)", file=sys.stderr)
        return 2
    with private_env_stack("route-bench") as (stack, token):
        runtime = stack.runtime_settings()
        result = asyncio.run(
            measure(stack.endpoint, token, stack.env_pid, runtime["state_dir"], args)
        )
    heads = ("p50 ms", "p90 ms", "client", "env", "agent", "total")
    print(f"{'route':<12} " + " ".join(f"{head:>8}" for head in heads))
    for name in ("orchard-env", "direct"):
        row, cpu = result[name], result[name]["cpu_ms_per_exec"]
        print(
            f"{name:<12} {row['p50_ms']:8.2f} {row['p90_ms']:8.2f} {cpu['client']:8.2f} "
            f"{cpu['orchard_env']:8.2f} {cpu['agent_and_command']:8.2f} {cpu['total']:8.2f}"
        )
    print("(CPU in ms per exec; agent = the sandbox's PID 1 and the commands it reaped)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
