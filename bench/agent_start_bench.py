"""What an agent costs from its fork to ready, and idle: gRPC at start against gRPC on demand.

    .venv/bin/python bench/agent_start_bench.py [--starts 20] [--idle-s 2] [--json FILE]

The local runtime's sandboxes start as forks of a pre-loaded agent (the zygote,
``orchard.inagent.zygote``). This bench does the same in one process: it imports what the
zygote imports, freezes its heap, then forks agents that run ``orchard.inagent.main.run`` with
a lane and a ready pipe, taking turns between the two ways an agent can start: with its gRPC
server at once, and with ``--grpc-on-demand`` (the lane alone until asked). For each start: the
wall time from the fork to the ready pipe's end, the agent's CPU by then (every thread, from
/proc/PID/task/*/schedstat), its threads, and for the first few its CPU while idle afterwards.
No namespaces: the sandbox's own setup is the same either way and left out.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "agent-start.json"
MODES = ("grpc-at-start", "grpc-on-demand")


def _cpu_ms(pid: int) -> float:
    """CPU of every thread of ``pid`` so far (ns precision)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat", encoding="ascii") as file:
            total += int(file.read().split()[0])
    return total / 1e6


def _start(directory: str, mode: str, index: int) -> tuple[int, float]:
    """Fork an agent; return its pid once it reported ready, and the wall ms it took."""
    from orchard.inagent.main import run  # noqa: PLC0415 - preloaded before the first fork

    read_end, write_end = os.pipe()
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the agent, as the zygote's child runs it
        os.close(read_end)
        os.set_inheritable(write_end, True)
        argv = [
            "--listen",
            f"unix:{directory}/{mode}-{index}.sock",
            "--lane",
            f"unix:{directory}/{mode}-{index}.lane",
            "--ready-fd",
            str(write_end),
            "--working-dir",
            directory,
            "--log-level",
            "WARNING",
        ]
        if mode == "grpc-on-demand":
            argv += ["--grpc-on-demand", "true"]
        os._exit(run(argv))
    os.close(write_end)
    while os.read(read_end, 4096):
        pass
    os.close(read_end)
    return pid, (time.perf_counter() - started) * 1e3


def measure(starts: int, idle_s: float, idle_samples: int) -> dict[str, Any]:
    from orchard.inagent.zygote import PRELOADED_MODULES  # noqa: PLC0415

    for name in PRELOADED_MODULES:
        importlib.import_module(name)
    gc.freeze()  # as the zygote does: children do not copy pages to count references
    samples: dict[str, dict[str, list[float]]] = {
        mode: {"ready_ms": [], "cpu_ms": [], "threads": [], "idle_cpu_ms_per_s": []}
        for mode in MODES
    }
    with tempfile.TemporaryDirectory(prefix="agent-start-") as directory:
        for index in range(starts):
            for mode in MODES:  # taking turns, so both see the same machine
                pid, ready_ms = _start(directory, mode, index)
                try:
                    cpu = _cpu_ms(pid)
                    row = samples[mode]
                    row["ready_ms"].append(ready_ms)
                    row["cpu_ms"].append(cpu)
                    row["threads"].append(len(os.listdir(f"/proc/{pid}/task")))
                    if index < idle_samples:
                        time.sleep(idle_s)
                        row["idle_cpu_ms_per_s"].append((_cpu_ms(pid) - cpu) / idle_s)
                finally:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
    return {
        "starts": starts,
        "idle_s": idle_s,
        "idle_samples": idle_samples,
        "method": "fork of a process that imported the zygote's modules and froze its heap; "
        "wall from fork to the ready pipe's end; CPU of all the agent's threads by then "
        "(schedstat); idle CPU over idle_s after ready",
        "modes": {
            mode: {
                figure: {
                    "p50": round(statistics.median(values), 3),
                    "min": round(min(values), 3),
                    "max": round(max(values), 3),
                }
                for figure, values in rows.items()
                if values
            }
            for mode, rows in samples.items()
        },
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'AGENT START (fork, p50 [min-max])':36} {'READY MS':>22} {'CPU MS':>22} "
        f"{'THREADS':>8} {'IDLE CPU MS/S':>22}"
    ]
    for mode, figures in result["modes"].items():

        def cell(name: str, figures: dict[str, Any] = figures) -> str:
            f = figures.get(name)
            return "-" if f is None else f"{f['p50']:.2f} [{f['min']:.2f}-{f['max']:.2f}]"

        lines.append(
            f"{mode:36} {cell('ready_ms'):>22} {cell('cpu_ms'):>22} "
            f"{figures['threads']['p50']:>8.0f} {cell('idle_cpu_ms_per_s'):>22}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--starts", type=int, default=20, help="starts per mode")
    parser.add_argument("--idle-s", type=float, default=2.0, help="idle time measured")
    parser.add_argument("--idle-samples", type=int, default=5, help="starts whose idle is measured")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    result = measure(args.starts, args.idle_s, args.idle_samples)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
