"""Benchmark the environment service at the issue's scale: 1000 sandboxes at once, 4 execs each.

    .venv/bin/python bench/env_bench.py [extra `orchard bench env` options]

Runs `orchard bench env --sandboxes 1000 --execs-per-sandbox 4 --json bench/results/env.json`
on a private etcd + orchard-env (local runtime, needs root; `make inagent-binary` first) and
prints its table. Options given here are appended, so they override those defaults, e.g.
`--sandboxes 100` for a quick look. Exits 1 when a sandbox failed or something leaked.
"""

from __future__ import annotations

import sys
from pathlib import Path

from orchard.sdk.cli import main

RESULTS = Path(__file__).resolve().parent / "results" / "env.json"
DEFAULTS = ["--sandboxes", "1000", "--execs-per-sandbox", "4", "--json", str(RESULTS)]

if __name__ == "__main__":
    sys.exit(main(["bench", "env", *DEFAULTS, *sys.argv[1:]]))
