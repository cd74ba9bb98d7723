"""What one test run of a built-in SWE task costs, the run every episode makes several times.

    .venv/bin/python bench/suite_tests_bench.py [--runs 10] [--tasks 5]

Materializes ``--tasks`` repositories of the built-in suite and runs each one's tests as the
sandboxes do (``python -m pytest -q -p no:cacheprovider`` in the repository, with the
interpreter the ``host`` image runs), ``--runs`` times per configuration, one at a time:

- ``shipped``: the repository as the suite ships it (its pytest configuration turns plugin
  autoloading off),
- ``autoload``: the same repository with autoloading on (what every run paid before): every
  pytest plugin installed beside the interpreter is imported,
- floors: ``python -c "import pytest"`` (what any pytest run pays) and ``python -c pass``.

Reported per configuration: CPU seconds per run (user + system of the child, from
``getrusage``) and wall seconds, median and range. Writes ``bench/results/suite_tests.json`` and
prints a table. Exits 1 when a run does not run the tests (a usage error, no tests collected).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from orchard.tasks.swe_suite import generate_suite
from orchard.tasks.swe_tasks import materialize

RESULTS = Path(__file__).resolve().parent / "results" / "suite_tests.json"
AUTOLOAD_OFF = "--disable-plugin-autoload"


def _timed(argv: list[str], cwd: Path) -> tuple[float, float]:
    """(CPU seconds of the child, wall seconds) of one run; raises unless it exited 0 or 1
    (pytest's exit when a test fails: a task's tests fail at its base commit)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(argv)} in {cwd} exited {done.returncode}: {done.stdout}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def _summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    cpu = [c for c, _ in samples]
    wall = [w for _, w in samples]
    return {
        "runs": len(samples),
        "cpu_s_median": statistics.median(cpu),
        "cpu_s_min": min(cpu),
        "cpu_s_max": max(cpu),
        "wall_s_median": statistics.median(wall),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per configuration")
    parser.add_argument("--tasks", type=int, default=5, help="suite repositories to run")
    args = parser.parse_args()
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    with tempfile.TemporaryDirectory(prefix="orchard-suite-bench-") as scratch:
        root = Path(scratch)
        shipped: list[Path] = []
        autoload: list[Path] = []
        for task in generate_suite(max(5, args.tasks), seed=0)[: args.tasks]:
            for kind, into in (("shipped", shipped), ("autoload", autoload)):
                repo = Path(materialize(task.blueprint, root / kind).repo_path)
                if kind == "autoload":
                    config = repo / "pyproject.toml"
                    config.write_text(config.read_text().replace(AUTOLOAD_OFF, ""))
                into.append(repo)
        configs: dict[str, tuple[list[str], list[Path]]] = {
            "shipped": (pytest, shipped),
            "autoload": (pytest, autoload),
            "floor: import pytest": ([sys.executable, "-c", "import pytest"], shipped),
            "floor: python -c pass": ([sys.executable, "-c", "pass"], shipped),
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
        # Interleaved: each round runs every configuration once, so drift hits them alike.
        for round_ in range(args.runs):
            for name, (argv, repos) in configs.items():
                samples[name].append(_timed(argv, repos[round_ % len(repos)]))
    results: dict[str, Any] = {
        "python": sys.version.split()[0],
        "tasks": args.tasks,
        "configs": {name: _summary(s) for name, s in samples.items()},
    }
    shipped_cpu = results["configs"]["shipped"]["cpu_s_median"]
    results["autoload_over_shipped"] = results["configs"]["autoload"]["cpu_s_median"] / shipped_cpu
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"{'configuration':<24} {'CPU s/run (median)':>19} {'range':>15} {'wall s':>8}")
    for name, row in results["configs"].items():
        spread = f"{row['cpu_s_min']:.3f}-{row['cpu_s_max']:.3f}"
        print(f"{name:<24} {row['cpu_s_median']:>19.3f} {spread:>15} {row['wall_s_median']:>8.3f}")
    print(f"autoload / shipped: x{results['autoload_over_shipped']:.1f} CPU per test run")
    print(f"wrote {RESULTS}")
    return 0


def _main() -> int:
    try:
        return main()
    except RuntimeError as exc:
        sys.stderr.write(f"suite_tests_bench: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(_main())
