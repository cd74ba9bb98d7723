"""``orchard experiment check|run|report FILE``: a recipe under several settings and seeds,
compared with intervals (`orchard.sdk.experiment`, run by `orchard.recipes.experiment`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from orchard.core.config import ConfigError
from orchard.sdk.cli.output import print_table
from orchard.sdk.cli.recipe import stack_from_args, stack_options
from orchard.sdk.experiment import Experiment, arm_recipe, load_experiment, recipe_file

__all__ = ["add_experiment_commands"]

_ABOUT = (
    "An experiment file names a recipe, the seeds, the arms (each a name and the recipe "
    "settings it changes) and the comparisons to report. Each arm runs once per seed as an "
    "ordinary recipe run under the experiment's folder; runs of one seed share the stages they "
    "have in common (an arm that changes only RL trains on the first arm's SFT model). The "
    "report (report/experiment.md with plots) gives each arm's held-out resolve rate per seed "
    "and pooled with intervals, the spread across seeds, and each comparison's paired "
    "difference with a bootstrap interval."
)


def add_experiment_commands(subparsers: Any, formatter: type[argparse.HelpFormatter]) -> None:
    experiment = subparsers.add_parser(
        "experiment",
        help="experiments: a recipe under several settings and seeds, compared",
        description=_ABOUT,
        formatter_class=formatter,
    )
    commands = experiment.add_subparsers(
        dest="experiment_command", metavar="COMMAND", required=True
    )
    check = commands.add_parser(
        "check",
        help="validate an experiment and list its runs",
        description="Validate FILE and every arm's recipe (each problem names the arm) and list "
        "the runs it makes, with what each arm changes.",
        formatter_class=formatter,
    )
    check.add_argument("file", type=Path, help="the experiment file")
    check.set_defaults(run=_check)
    run = commands.add_parser(
        "run",
        help="run an experiment's arms and seeds, then write its report",
        description="Run every arm of FILE once per seed against the services `orchard up` runs "
        "(or --stack), seed by seed, then write report/experiment.md. Finished runs and stages "
        "are not run again: after an interruption the same command goes on where it stopped.",
        epilog="examples:\n"
        "  orchard up --detach && orchard experiment run recipes/experiment-swe.yaml\n"
        "  orchard experiment run exp.yaml --arm main --seed 0   # one run of it",
        formatter_class=formatter,
    )
    run.add_argument("file", type=Path, help="the experiment file")
    run.add_argument("--arm", action="append", default=[], help="run only this arm; repeatable")
    run.add_argument(
        "--seed", action="append", type=int, default=[], help="run only this seed; repeatable"
    )
    stack_options(run)
    run.set_defaults(run=_run)
    report = commands.add_parser(
        "report",
        help="write an experiment's report from the runs that finished",
        description="Rewrite report/experiment.md and experiment.json from FILE's finished "
        "runs; runs nothing.",
        formatter_class=formatter,
    )
    report.add_argument("file", type=Path, help="the experiment file")
    report.set_defaults(run=_report)


def _load(path: Path) -> tuple[Experiment, Path] | None:
    try:
        return load_experiment(path)
    except ConfigError as exc:
        sys.stderr.write(f"orchard: {path} is not a valid experiment:\n")
        for problem in exc.problems:
            sys.stderr.write(f"  {problem}\n")
        return None


def _check(args: argparse.Namespace) -> int:
    loaded = _load(args.file)
    if loaded is None:
        return 2
    experiment, out = loaded
    base = args.file.resolve().parent
    sys.stdout.write(f"experiment {experiment.name}: {args.file}\n")
    sys.stdout.write(f"  recipe  {recipe_file(experiment, base)}\n")
    sys.stdout.write(f"  seeds   {', '.join(map(str, experiment.seeds))}\n")
    sys.stdout.write(f"  output  {out}\n\n")
    rows = []
    for arm in experiment.arms:
        recipe = arm_recipe(experiment, arm, experiment.seeds[0], base=base, output_dir=out)
        rows.append([arm.name, recipe.name, arm.about or "-", _flat(arm.settings) or "-"])
    print_table(["arm", "run name (first seed)", "what it is", "changes"], rows)
    for comparison in experiment.comparisons:
        on = f" on {comparison.domain} tasks" if comparison.domain else ""
        sys.stdout.write(f"compare: {comparison.name}: {comparison.a} vs {comparison.b}{on}\n")
    return 0


def _flat(settings: dict[str, Any], prefix: str = "") -> str:
    parts = []
    for key, value in settings.items():
        if isinstance(value, dict):
            parts.append(_flat(value, f"{prefix}{key}."))
        else:
            parts.append(f"{prefix}{key}={value}")
    return ", ".join(p for p in parts if p)


def _run(args: argparse.Namespace) -> int:
    loaded = _load(args.file)
    if loaded is None:
        return 2
    experiment, out = loaded
    names = [arm.name for arm in experiment.arms]
    unknown = [a for a in args.arm if a not in names] + [
        str(s) for s in args.seed if s not in experiment.seeds
    ]
    if unknown:
        sys.stderr.write(
            f"orchard: {args.file} has no arm or seed {', '.join(unknown)}: its arms are "
            f"{', '.join(names)}; its seeds {', '.join(map(str, experiment.seeds))}\n"
        )
        return 2
    stack = stack_from_args(args)
    if stack is None:
        return 2
    from orchard.recipes.experiment import run_experiment  # noqa: PLC0415
    from orchard.recipes.pipeline import StageError  # noqa: PLC0415
    from orchard.recipes.workspace import RecipeMismatch  # noqa: PLC0415

    try:
        report = run_experiment(
            experiment,
            out,
            args.file.resolve().parent,
            stack,
            arms=args.arm,
            seeds=args.seed,
            progress=not args.no_progress,
            workers=args.workers,
            source=str(args.file),
        )
    except (StageError, RecipeMismatch, ValueError) as exc:
        sys.stderr.write(f"orchard: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write(
            "orchard: interrupted; run the same command again to go on where it stopped\n"
        )
        return 130
    sys.stdout.write(f"report: {report}\n")
    return 0


def _report(args: argparse.Namespace) -> int:
    loaded = _load(args.file)
    if loaded is None:
        return 2
    experiment, out = loaded
    try:
        from orchard.recipes.experiment import write_experiment_report  # noqa: PLC0415
    except ImportError:
        sys.stderr.write("orchard: experiment reports need the orchard-recipes package\n")
        return 2
    report = write_experiment_report(experiment, out, source=str(args.file))
    sys.stdout.write(f"report: {report}\n")
    return 0
