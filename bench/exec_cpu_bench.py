"""Where an exec's CPU goes: exec of `true` through orchard-env, by process, beside the load.

    .venv/bin/python bench/exec_cpu_bench.py [--sandboxes 50] [--calls 3000] [--rounds 4]
        [--concurrency 32] [--narrow 4] [--routes lane,grpc] [--json FILE]

Starts a private etcd + orchard-env (local runtime: needs root) for each route to the agents
(``lane``: Exec over the agents' exec lane, orchard-env's default; ``grpc``: the lane turned
off, every call over gRPC), creates ``--sandboxes`` sandboxes of the host image in each, then
runs ``--rounds`` rounds of ``--calls`` execs of `true` with ``--concurrency`` in flight, as
`orchard bench env` does for its sustained figure, the routes taking turns round by round so
both see the same load. With ``--narrow K`` every other round sends its execs to only K of the
sandboxes, so each agent sees its next call while it is still busy instead of waking from idle
for it: the difference between the two kinds of round is what waking a sleeping agent costs.

Each round reports, per exec: CPU ms of this client process (getrusage), orchard-env and the
agents (/proc/PID/stat; every agent is counted whether it got calls or not), the commands (the
agents' reaped children), and context switches of orchard-env and of the agents (all their
threads). The whole host's busy CPU per exec and its load (busy cores, from /proc/stat) show
how much other work shared the machine: compare rounds only at a similar load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchard.sdk import AsyncSandboxClient

if TYPE_CHECKING:
    from bench.bench_stack import private_env_stack
else:  # bench scripts run with bench/ on sys.path
    from bench_stack import private_env_stack

_TICK = os.sysconf("SC_CLK_TCK")
ROUTES = {"lane": "true", "grpc": "false"}
"""Each route to the agents, as orchard-env's ``exec_lane`` setting."""
PARTS = ("client", "orchard_env", "agents", "commands")


def process_cpu_s(pid: int, children: bool = False) -> float:
    """User + system CPU seconds of ``pid``, or of the children it reaped."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as file:
        fields = file.read().rpartition(")")[2].split()
    first = 13 if children else 11
    return (int(fields[first]) + int(fields[first + 1])) / _TICK


def context_switches(pid: int) -> int:
    """Voluntary and involuntary context switches of every thread of ``pid``."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status", encoding="ascii") as file:
                for line in file:
                    name, _, value = line.partition(":")
                    if name.endswith("ctxt_switches"):  # voluntary and nonvoluntary
                        total += int(value)
        except OSError:  # the thread ended meanwhile
            continue
    return total


def host_busy_s() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole host since boot."""
    with open("/proc/stat", encoding="ascii") as file:
        ticks = [int(value) for value in file.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks) - idle) / _TICK, sum(ticks) / _TICK


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Snapshot:
    """The counters one round compares."""

    def __init__(self, env_pid: int, agent_pids: list[int]) -> None:
        self.cpu = {
            "client": self_cpu_s(),
            "orchard_env": process_cpu_s(env_pid),
            "agents": sum(process_cpu_s(pid) for pid in agent_pids),
            "commands": sum(process_cpu_s(pid, children=True) for pid in agent_pids),
        }
        self.switches = {
            "orchard_env": context_switches(env_pid),
            "agents": sum(context_switches(pid) for pid in agent_pids),
        }
        self.host = host_busy_s()
        self.at = time.perf_counter()


def agent_pid(state_dir: str, sandbox_id: str) -> int:
    with open(os.path.join(state_dir, f"{sandbox_id}.json"), encoding="utf-8") as file:
        return int(json.load(file)["pid"])


class Route:
    """One stack's sandboxes, their agents and the call the rounds make."""

    def __init__(self, name: str, client: AsyncSandboxClient, env_pid: int) -> None:
        self.name = name
        self.client = client
        self.env_pid = env_pid
        self.sandboxes: list[Any] = []
        self.agents: list[int] = []
        self.spread = 0

    async def start(self, count: int, state_dir: str) -> None:
        self.sandboxes = list(
            await asyncio.gather(*(self.client.create(image="host") for _ in range(count)))
        )
        await asyncio.gather(*(sandbox.wait() for sandbox in self.sandboxes))
        self.agents = [agent_pid(state_dir, sandbox.id) for sandbox in self.sandboxes]
        self.spread = len(self.sandboxes)
        for index in range(2 * len(self.sandboxes)):  # warm every channel and agent
            await self.one(index)

    async def one(self, index: int) -> None:
        result = await self.sandboxes[index % self.spread].exec(["true"], timeout=60)
        if result.exit_code != 0:
            raise RuntimeError(f"`true` exited {result.exit_code}")

    async def close(self) -> None:
        await asyncio.gather(*(s.delete() for s in self.sandboxes), return_exceptions=True)


async def measure(stacks: list[tuple[str, str, str, int, str]], args: Any) -> list[dict[str, Any]]:
    """The rounds, the routes taking turns; ``stacks``: (route, endpoint, token, orchard-env's
    pid, the runtime's state folder) each."""
    async with contextlib.AsyncExitStack() as exits:
        routes = []
        for name, endpoint, token, env_pid, state_dir in stacks:
            client = await exits.enter_async_context(AsyncSandboxClient(endpoint, token=token))
            route = Route(name, client, env_pid)
            exits.push_async_callback(route.close)
            await route.start(args.sandboxes, state_dir)
            routes.append(route)
        rounds = []
        for number in range(args.rounds):
            narrow = args.narrow and number % 2 == 1
            for route in routes:
                count = len(route.sandboxes)
                route.spread = min(args.narrow, count) if narrow else count
                calls = iter(range(args.calls))
                before = Snapshot(route.env_pid, route.agents)
                await asyncio.gather(*(_worker(route.one, calls) for _ in range(args.concurrency)))
                after = Snapshot(route.env_pid, route.agents)
                rounds.append(
                    {"route": route.name} | _round(before, after, args.calls, route.spread)
                )
                print(json.dumps(rounds[-1]), file=sys.stderr)
        return rounds


async def _worker(one: Callable[[int], Awaitable[None]], calls: Iterator[int]) -> None:
    for index in calls:  # shared by the workers: each index once
        await one(index)


def _round(before: Snapshot, after: Snapshot, calls: int, spread: int) -> dict[str, Any]:
    wall = after.at - before.at
    cpu = {part: (after.cpu[part] - before.cpu[part]) / calls * 1e3 for part in PARTS}
    busy = after.host[0] - before.host[0]
    return {
        "sandboxes_used": spread,
        "execs_per_s": round(calls / wall, 1),
        "cpu_ms_per_exec": {
            **{k: round(v, 3) for k, v in cpu.items()},
            "all": round(sum(cpu.values()), 3),
        },
        "context_switches_per_exec": {
            part: round((after.switches[part] - before.switches[part]) / calls, 1)
            for part in after.switches
        },
        "host_busy_ms_per_exec": round(busy / calls * 1e3, 3),
        "host_load": round(busy / wall, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sandboxes", type=int, default=50)
    parser.add_argument("--calls", type=int, default=3000, help="execs per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--narrow", type=int, default=4, help="every other round: K sandboxes")
    parser.add_argument(
        "--routes", default="lane,grpc", help="routes to the agents, compared: lane, grpc"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (the local runtime)", file=sys.stderr)
        return 2
    routes = [route for route in args.routes.split(",") if route]
    if not routes or set(routes) - set(ROUTES):
        print(f"--routes: choose from {', '.join(ROUTES)}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as exits:
        stacks = []
        for route in routes:
            stack, token = exits.enter_context(
                private_env_stack("exec-cpu-bench", settings=[f"exec_lane={ROUTES[route]}"])
            )
            state_dir = stack.runtime_settings()["state_dir"]
            stacks.append((route, stack.endpoint, token, stack.env_pid, state_dir))
        rounds = asyncio.run(measure(stacks, args))
    heads = (
        "route",
        "used",
        "execs/s",
        "client",
        "env",
        "agents",
        "command",
        "all",
        "env cs",
        "agent cs",
        "host",
        "load",
    )
    print(" ".join(f"{head:>8}" for head in heads))
    for row in rounds:
        cpu, switches = row["cpu_ms_per_exec"], row["context_switches_per_exec"]
        values = (
            row["route"],
            row["sandboxes_used"],
            row["execs_per_s"],
            cpu["client"],
            cpu["orchard_env"],
            cpu["agents"],
            cpu["commands"],
            cpu["all"],
            switches["orchard_env"],
            switches["agents"],
            row["host_busy_ms_per_exec"],
            row["host_load"],
        )
        print(" ".join(f"{value:>8}" for value in values))
    print(
        "(CPU in ms per exec of `true`; cs: context switches per exec, all threads; host: the "
        "whole machine's busy CPU ms per exec, others' work included; load: busy cores)"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"arguments": vars(args) | {"json": str(args.json)}, "rounds": rounds}, indent=2
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
