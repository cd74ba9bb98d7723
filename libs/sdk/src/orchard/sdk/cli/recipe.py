"""``orchard recipe check FILE`` validates a recipe and shows what it would run;
``orchard recipe run FILE`` runs it against the running services."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from orchard.core.config import ConfigError
from orchard.sdk.cli.output import print_json, print_table
from orchard.sdk.recipe import BUILTIN_RECIPES, STAGES, Recipe, builtin_recipe, load_recipe

__all__ = ["add_recipe_commands", "stack_from_args", "stack_options"]


def add_recipe_commands(subparsers: Any, formatter: type[argparse.HelpFormatter]) -> None:
    recipe = subparsers.add_parser(
        "recipe",
        help="recipes: what to train, on which tasks, and how",
        description=(
            "A recipe is one YAML file naming the tasks, harnesses, teacher, student and the "
            f"stages ({' -> '.join(STAGES)}). `check` validates one and shows its plan."
        ),
        formatter_class=formatter,
    )
    commands = recipe.add_subparsers(dest="recipe_command", metavar="COMMAND", required=True)
    check = commands.add_parser(
        "check",
        help="validate a recipe and show its stages",
        description=(
            "Validate FILE (every problem is listed with its key and line) and print the stages "
            "it runs with their main settings. Without FILE, the built-in recipe."
        ),
        epilog=(
            "examples:\n"
            "  orchard recipe check my-recipe.yaml\n"
            "  orchard recipe check            # the built-in recipe `make demo` runs"
        ),
        formatter_class=formatter,
    )
    check.add_argument("file", nargs="?", type=Path, help="the recipe (default: a built-in one)")
    _builtin_option(check)
    check.add_argument("--json", action="store_true", help="print the validated recipe as JSON")
    check.set_defaults(run=_check)
    run = commands.add_parser(
        "run",
        help="run a recipe against the running services",
        description=(
            "Run FILE's stages in order against the services `orchard up` runs (etcd, "
            "orchard-env, orchard-reward, orchard-rollout, which runs every rollout, and "
            "orchard-trainer, which trains), with a progress bar per stage, and write the report "
            "(report/report.md with plots) into the recipe's output folder. A stage that "
            "finished is not run again: after an interruption the same command resumes at the "
            "first unfinished stage. --stage runs the named stages alone, again. Without FILE, "
            "the built-in recipe."
        ),
        epilog=(
            "examples:\n"
            "  orchard up --detach && orchard recipe run          # the built-in recipe\n"
            "  orchard recipe run --builtin claw                  # Claw through agent programs\n"
            "  orchard recipe run --builtin gui                   # web tasks in browsers\n"
            "  orchard recipe run my-recipe.yaml\n"
            "  orchard recipe run my-recipe.yaml --stage evaluate # evaluate again"
        ),
        formatter_class=formatter,
    )
    run.add_argument("file", nargs="?", type=Path, help="the recipe (default: a built-in one)")
    _builtin_option(run)
    run.add_argument(
        "--stage",
        action="append",
        choices=STAGES,
        default=[],
        help="run only this stage (again); repeatable",
    )
    run.add_argument("--seed", type=int, default=0, help="seed of the run (default 0)")
    stack_options(run)
    run.set_defaults(run=_run)


def stack_options(parser: argparse.ArgumentParser) -> None:
    """The options of commands that run recipes: workers, progress, and which services."""
    parser.add_argument(
        "--workers", type=int, default=4, help="rollouts that run at once (default 4)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="the state dir of the `orchard up` to use (default: $ORCHARD_STATE_DIR, else "
        "the standard one)",
    )
    parser.add_argument(
        "--stack",
        type=Path,
        default=None,
        help="a JSON or YAML file naming the services to use instead of `orchard up`'s: env, "
        "reward, rollout, trainer (HOST:PORT), etcd (URL), artifacts (the store's URL); the "
        "token of orchard-env from $ORCHARD_TOKEN",
    )


def stack_from_args(args: argparse.Namespace) -> Any:
    """The `StackEndpoints` the options of `stack_options` name, or None after saying on
    stderr what is wrong (the orchard-recipes package missing, no `orchard up` running, a bad
    stack file)."""
    if args.workers < 1:
        sys.stderr.write("orchard: --workers must be at least 1\n")
        return None
    try:
        from orchard.recipes.workspace import StackEndpoints  # noqa: PLC0415
    except ImportError:
        sys.stderr.write(
            "orchard: running recipes needs the orchard-recipes package (pip install "
            "orchard-recipes), the client that runs a recipe's stages against the services\n"
        )
        return None
    try:
        if args.stack is not None:
            return StackEndpoints.from_file(args.stack)
        return StackEndpoints.from_state_dir(args.state_dir)
    except (FileNotFoundError, ValueError) as exc:
        sys.stderr.write(f"orchard: {exc}\n")
        return None


def _builtin_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--builtin",
        choices=BUILTIN_RECIPES,
        default="swe",
        help="the built-in recipe used when no file is given: swe (software engineering, what "
        "`make demo` runs), claw (personal-assistant tasks through agent programs; needs "
        "`make harnesses`) or gui (web tasks in browser sandboxes; needs orchard-rollout's "
        "gui.browser_dir, from `make gui-browser`); default swe",
    )


def _path(args: argparse.Namespace) -> Path:
    return Path(args.file) if args.file else builtin_recipe(args.builtin)


def _load(path: Path) -> Recipe | None:
    """The recipe, or None after saying on stderr what is wrong with it."""
    try:
        return load_recipe(path)
    except ConfigError as exc:
        sys.stderr.write(f"orchard: {path} is not a valid recipe:\n")
        for problem in exc.problems:
            sys.stderr.write(f"  {problem}\n")
        return None


def _check(args: argparse.Namespace) -> int:
    path = _path(args)
    recipe = _load(path)
    if recipe is None:
        return 2
    if args.json:
        print_json(recipe.model_dump(mode="json"))
        return 0
    sys.stdout.write(f"recipe {recipe.name}: {path}\n")
    sys.stdout.write(f"  tasks     {_tasks(recipe)}\n")
    sys.stdout.write(f"  harnesses {', '.join(recipe.harnesses)}\n")
    if recipe.stages.evaluate.harnesses:
        held_out = ", ".join(recipe.stages.evaluate.harnesses)
        sys.stdout.write(f"  held out  {held_out} (evaluated only)\n")
    sys.stdout.write(f"  teacher   {recipe.teacher.endpoint} ({recipe.teacher.model})\n")
    sys.stdout.write(f"  student   {recipe.student.model} on the {recipe.student.engine} engine\n")
    sys.stdout.write(f"  output    {recipe.output_dir}\n\n")
    print_table(
        ["stage", "runs", "settings"],
        [[name, "yes" if _stage(recipe, name).enabled else "no", _settings(recipe, name)]
         for name in STAGES],
    )  # fmt: skip
    return 0


def _run(args: argparse.Namespace) -> int:
    path = _path(args)
    recipe = _load(path)
    if recipe is None:
        return 2
    stack = stack_from_args(args)
    if stack is None:
        return 2
    from orchard.recipes.pipeline import StageError, run_recipe  # noqa: PLC0415
    from orchard.recipes.workspace import RecipeMismatch  # noqa: PLC0415

    try:
        report = run_recipe(
            recipe,
            stack,
            only=args.stage,
            progress=not args.no_progress,
            workers=args.workers,
            seed=args.seed,
        )
    except (StageError, RecipeMismatch, ValueError) as exc:
        sys.stderr.write(f"orchard: {exc}\n")
        return 1
    except OSError as exc:
        # The output folder (or a file in it) cannot be written: say which, not a traceback.
        sys.stderr.write(
            f"orchard: {exc.strerror or exc}: {exc.filename or recipe.output_dir}; give the "
            "recipe an output_dir this user can write\n"
        )
        return 1
    except KeyboardInterrupt:
        sys.stderr.write(
            "orchard: interrupted; run the same command again to resume at the first "
            "unfinished stage\n"
        )
        return 130
    sys.stdout.write(f"report: {report}\n")
    return 0


def _stage(recipe: Recipe, name: str) -> Any:
    return getattr(recipe.stages, name)


_SUITE_NAMES = {"builtin": "built-in suite", "claw": "Claw suite", "gui": "GUI suite"}


def _tasks(recipe: Recipe) -> str:
    tasks = recipe.tasks
    if tasks.jsonl is not None:
        files = [f"{s}={getattr(tasks.jsonl, s)}" for s in ("sft", "rl", "evaluate")]
        return "JSONL " + ", ".join(files)
    suites = []
    for source in tasks.sources:
        spec = getattr(tasks, source)
        suites.append(f"{_SUITE_NAMES[source]}, {spec.count} tasks (seed {spec.seed})")
    split = tasks.split
    return (
        " + ".join(suites)
        + f"; split sft {split.sft:g} / rl {split.rl:g} / evaluate {split.evaluate:g}"
    )


def _settings(recipe: Recipe, name: str) -> str:
    s = recipe.stages
    if name == "collect":
        return (
            f"{s.collect.attempts_per_task} attempts/task, {s.collect.budget.max_steps} steps max"
        )
    if name == "credit":
        return f"judge {s.credit.judge_endpoint}, epsilon {s.credit.epsilon:g}"
    if name == "curate":
        shortest = "on" if s.curate.shortest_success_per_task else "off"
        return f"max {s.curate.max_tokens} tokens, shortest success per task {shortest}"
    if name == "sft":
        sft = s.sft
        return (
            f"{sft.epochs} epochs, lr {sft.learning_rate:g}, batch {sft.batch_size}, "
            f"ZeRO {sft.zero_stage}"
        )
    if name == "rl":
        sampler = s.rl.sampler
        estimator = {"ppo": "PPO (value model)", "grpo": "GRPO"}.get(s.rl.estimator, "")
        distillation = s.rl.distillation
        if distillation is not None and distillation.teacher is not None:
            teacher = distillation.teacher
            how = f"trained {teacher.train}" if teacher.train else f"model {teacher.model}"
            estimator = f"OPD (teacher: {how}, coef {distillation.coef:g})"
        rubric = s.rl.rubric
        shaped = f", rubric process reward {rubric.weight:g} by {rubric.judge}" if rubric else ""
        return (
            f"{s.rl.steps} steps x {s.rl.groups_per_step} groups, {sampler.kind} N={sampler.n}, "
            f"{estimator}{shaped}"
        )
    if name == "rerank":
        rerank = s.rerank
        history = f" + {len(rerank.history)} earlier run(s)" if rerank.history else ""
        return (
            f"best of {rerank.k} by a value model of {rerank.model or 'the last'} model, "
            f"history {'+'.join(rerank.sources) or '-'}{history}"
        )
    k = s.evaluate.attempts_per_task
    passk = f", pass@{k} and pass^{k}" if k > 1 else ""
    return f"{k} attempts/task, {s.evaluate.confidence:.0%} intervals{passk}"
