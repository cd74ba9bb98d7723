"""Benchmark the environment service at the issue's scale: 1000 sandboxes at once, 4 execs each.

    .venv/bin/python bench/env_bench.py [extra `orchard bench env` options]

Runs `orchard bench env --curve 100,400,1000 --execs-per-sandbox 4 --profile --json
bench/results/env.json` on a private etcd + orchard-env (local runtime, needs root; `make
inagent-binary` first): the lifecycle at 100, 400 and 1000 sandboxes (the cost curve; the table
shows 1000), each figure beside its floor measured in the same run, the CPU split by process,
and py-spy flame graphs of orchard-env and one agent in bench/results/. Options given here are
appended, so they override those defaults; `--sandboxes N` (or a `--curve` of its own) replaces
the curve, e.g. `--sandboxes 50` for a quick look. Exits 1 when a sandbox failed or something
leaked.
"""

from __future__ import annotations

import sys
from pathlib import Path

from orchard.sdk.cli import main

RESULTS = Path(__file__).resolve().parent / "results" / "env.json"
DEFAULTS = ["--execs-per-sandbox", "4", "--profile", "--json", str(RESULTS)]
CURVE = ["--curve", "100,400,1000"]


def arguments(extra: list[str]) -> list[str]:
    """The command line: the defaults, the curve unless a size is given, then ``extra``."""
    sized = any(arg.split("=")[0] in ("--sandboxes", "-n", "--curve") for arg in extra)
    return ["bench", "env", *DEFAULTS, *([] if sized else CURVE), *extra]


if __name__ == "__main__":
    sys.exit(main(arguments(sys.argv[1:])))
