"""Running an experiment: every arm of it once per seed, against one stack, then one report.

Each run is an ordinary recipe run (`run_recipe`) in ``<out>/<arm>/seed-<seed>``, resumable as
any. Runs of one seed share what they have in common: before an arm's run starts, each stage
whose inputs are the same as a finished stage of an earlier arm of that seed (the recipe's
settings up to and including that stage, and the seed: `stage_keys`) is copied from there
rather than run again, and so are the held-out evaluations of the models those stages made
(`evaluation_key`). So an arm that changes only RL trains on the very SFT model the first arm
trained, and the comparison of their RL stages is paired. ``shared.json`` in a run's folder
says what came from where.

`write_experiment_report` reads every run's ``report/report.json`` and ``rl/done.json`` and
writes ``experiment.md``, ``experiment.json`` and the plots into ``<out>/report``: per arm and
model the held-out resolve rate of each seed, pooled over the seeds with a Wilson interval, the
mean and spread across seeds; each comparison's difference with a paired bootstrap interval
(tasks resampled, each with all its seeds); the RL reward curves across seeds; the RL groups
with signal per 1,000 rollouts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, stdev
from typing import Any

from orchard.recipes.pipeline import run_recipe
from orchard.recipes.workspace import RunDir, StackEndpoints, write_json
from orchard.sdk.experiment import Experiment, arm_recipe
from orchard.sdk.recipe import STAGES
from orchard.sdk.report import wilson_interval

__all__ = [
    "ModelRow",
    "evaluation_key",
    "paired_difference",
    "run_experiment",
    "share_stages",
    "stage_keys",
    "write_experiment_report",
]

log = logging.getLogger(__name__)

SHARED = "shared.json"
"""In a run's folder: which stages and evaluations were copied from which earlier run."""

BOOTSTRAP_SAMPLES = 2000


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _common(saved: Mapping[str, Any]) -> dict[str, Any]:
    """What every stage of a run depends on: the recipe without its name, folder and stages."""
    return {k: v for k, v in saved.items() if k not in ("name", "output_dir", "stages")}


def stage_keys(saved: Mapping[str, Any], seed: int) -> dict[str, str]:
    """Per stage, a digest of everything its outputs depend on: the recipe as the run saved it
    (``recipe.json``) apart from its name and folder, the seed, and the settings of this stage
    and of every stage before it. Two runs with the same key for a stage make the same outputs
    for it."""
    keys: dict[str, str] = {}
    chain = _digest(_common(saved), seed)
    for stage in STAGES:
        chain = _digest(chain, stage, saved["stages"].get(stage))
        keys[stage] = chain
    return keys


def evaluation_key(saved: Mapping[str, Any], seed: int) -> str:
    """A digest of what a held-out evaluation of given weights depends on besides the weights:
    the recipe apart from its name, folder and stages, the seed, the evaluate settings, and the
    RL budget (episodes are evaluated at RL's final step budget)."""
    stages = saved["stages"]
    rl = stages["rl"]
    return _digest(_common(saved), seed, stages["evaluate"], rl.get("budget"), rl.get("curriculum"))


def _saved(run: Path) -> tuple[dict[str, Any], int] | None:
    """The recipe a run folder saved and its seed; None before the run started there."""
    try:
        data: dict[str, Any] = json.loads((run / "recipe.json").read_text(encoding="utf-8"))
        seed = int(json.loads((run / "seed.json").read_text(encoding="utf-8"))["seed"])
    except (OSError, ValueError, KeyError):
        return None
    return data, seed


def _done(run: Path, stage: str) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((run / stage / "done.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data


def share_stages(run: Path, earlier: Sequence[Path]) -> dict[str, Any]:
    """Copy into ``run`` (whose ``recipe.json`` and ``seed.json`` exist) each stage that an
    ``earlier`` run of the same seed finished with the same `stage_keys` entry, in stage order
    (stages turned off passed over), until the first stage none has; then the held-out
    evaluations of the base model and of the models those stages made, from an earlier run
    with the same `evaluation_key`. Returns
    (and writes to ``shared.json``) what came from where; stages ``run`` finished itself are
    left alone."""
    saved = _saved(run)
    if saved is None:
        raise FileNotFoundError(f"{run} holds no recipe.json and seed.json to compare")
    mine, seed = saved
    keys = stage_keys(mine, seed)
    # Earlier runs of the seed: their folder, recipe and stage keys.
    candidates = []
    for other in earlier:
        found = _saved(other)
        if found is not None and found[1] == seed and other != run:
            candidates.append((other, found[0], stage_keys(found[0], seed)))
    record: dict[str, Any] = (
        json.loads((run / SHARED).read_text(encoding="utf-8")) if (run / SHARED).exists() else {}
    )
    stages: dict[str, str] = record.setdefault("stages", {})
    for stage in STAGES:
        if _done(run, stage) is not None or not mine["stages"].get(stage, {}).get("enabled"):
            # Finished here already, or off (it makes nothing; its settings are in the keys).
            continue
        source = next(
            (
                other
                for other, _, their_keys in candidates
                if their_keys[stage] == keys[stage] and _done(other, stage) is not None
            ),
            None,
        )
        if source is None:
            break
        shutil.rmtree(run / stage, ignore_errors=True)
        shutil.copytree(source / stage, run / stage)
        stages[stage] = f"{source.parent.name}/{source.name}"
    evaluations: dict[str, str] = record.setdefault("evaluations", {})
    if _done(run, "evaluate") is None:
        versions = {"base": "base"}
        for stage in ("sft", "rl"):
            done = _done(run, stage)
            if done and done.get("weights"):
                versions[stage] = str(done["weights"]["version"])
        mine_key = evaluation_key(mine, seed)
        for other, theirs, _ in candidates:
            if evaluation_key(theirs, seed) != mine_key:
                continue
            for model, version in versions.items():
                target = run / "evaluate" / f"{model}.json"
                source_file = other / "evaluate" / f"{model}.json"
                if target.exists() or not source_file.exists():
                    continue
                result = json.loads(source_file.read_text(encoding="utf-8"))
                if result.get("weight_version") != version or result.get("line"):
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                for path in other.joinpath("evaluate").glob(f"{model}.*"):
                    shutil.copy2(path, run / "evaluate" / path.name)
                evaluations[model] = f"{other.parent.name}/{other.name}"
    write_json(run / SHARED, record)
    return record


def run_experiment(
    experiment: Experiment,
    out: Path,
    base: Path,
    stack: StackEndpoints,
    *,
    arms: Sequence[str] = (),
    seeds: Sequence[int] = (),
    progress: bool = True,
    workers: int = 4,
    say: Callable[[str], None] = print,
    source: str = "",
) -> Path:
    """Run the experiment's arms (or ``arms``) with its seeds (or ``seeds``), seed by seed and
    in the file's order within a seed, sharing stages as the module says; then write the
    report. Returns the report's path. ``source`` names the experiment file in the report."""
    unknown = [a for a in arms if a not in {x.name for x in experiment.arms}]
    if unknown:
        names = ", ".join(a.name for a in experiment.arms)
        raise ValueError(f"no arm {', '.join(unknown)}: the arms are {names}")
    chosen = [a for a in experiment.arms if not arms or a.name in arms]
    out.mkdir(parents=True, exist_ok=True)
    timings = _read_timings(out)
    for seed in seeds or experiment.seeds:
        finished: list[Path] = []
        for arm in experiment.arms:
            recipe = arm_recipe(experiment, arm, seed, base=base, output_dir=out)
            assert recipe.output_dir is not None
            folder = Path(recipe.output_dir)
            if arm not in chosen:
                if _saved(folder) is not None:
                    finished.append(folder)
                continue
            say(f"experiment {experiment.name}: arm {arm.name}, seed {seed}")
            # The run's own folder first (recipe.json, seed.json), then what it can share.
            RunDir.open(recipe).claim_seed(seed)
            shared = share_stages(folder, finished)
            if shared["stages"] or shared["evaluations"]:
                say(
                    "  shared: "
                    + ", ".join(
                        [f"{s} from {w}" for s, w in shared["stages"].items()]
                        + [f"{m} evaluation from {w}" for m, w in shared["evaluations"].items()]
                    )
                )
            started = time.monotonic()
            run_recipe(recipe, stack, progress=progress, workers=workers, seed=seed, say=say)
            timings[f"{arm.name}/seed-{seed}"] = timings.get(f"{arm.name}/seed-{seed}", 0.0) + (
                time.monotonic() - started
            )
            write_json(out / "timings.json", timings)
            finished.append(folder)
    return write_experiment_report(experiment, out, source=source)


def _read_timings(out: Path) -> dict[str, float]:
    try:
        data = json.loads((out / "timings.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()}


# -- the report ----------------------------------------------------------------------------------


@dataclass
class ModelRow:
    """One (arm, model): its held-out results per seed and per task."""

    arm: str
    model: str
    per_seed: dict[int, tuple[int, int]] = field(default_factory=dict)
    """seed -> (resolved, attempts)."""
    per_task: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)
    """(seed, task) -> (successes, attempts), summed over harnesses."""

    @property
    def resolved(self) -> int:
        return sum(r for r, _ in self.per_seed.values())

    @property
    def attempts(self) -> int:
        return sum(n for _, n in self.per_seed.values())

    def rates(self) -> list[float]:
        return [r / n for r, n in self.per_seed.values() if n]

    def of_domain(self, domain: str) -> ModelRow:
        """The same model's results on the held-out tasks of `domain` ("swe", "claw") only."""
        per_task = {k: v for k, v in self.per_task.items() if task_domain(k[1]) == domain}
        per_seed: dict[int, tuple[int, int]] = {}
        for (seed, _), (c, n) in per_task.items():
            have = per_seed.get(seed, (0, 0))
            per_seed[seed] = (have[0] + c, have[1] + n)
        return ModelRow(self.arm, self.model, per_seed, per_task)


def task_domain(task_id: str) -> str:
    """The domain of a held-out task by its id: the Claw and GUI suites' ids name them."""
    prefix = task_id.partition("/")[0]
    return prefix if prefix in ("claw", "gui") else "swe"


def _evaluations(run: Path) -> list[dict[str, Any]]:
    try:
        report = json.loads((run / "report" / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    evaluations: list[dict[str, Any]] = report.get("evaluations", [])
    return evaluations


def collect_rows(experiment: Experiment, out: Path) -> dict[tuple[str, str], ModelRow]:
    """Every (arm, model) the finished runs evaluated, with their per-seed and per-task
    results."""
    rows: dict[tuple[str, str], ModelRow] = {}
    for arm in experiment.arms:
        for seed in experiment.seeds:
            for evaluation in _evaluations(out / arm.name / f"seed-{seed}"):
                row = rows.setdefault(
                    (arm.name, evaluation["model"]), ModelRow(arm.name, evaluation["model"])
                )
                row.per_seed[seed] = (int(evaluation["resolved"]), int(evaluation["attempts"]))
                for harness in evaluation.get("harnesses", []):
                    for task, (n, c) in harness.get("tasks", {}).items():
                        have = row.per_task.get((seed, task), (0, 0))
                        row.per_task[(seed, task)] = (have[0] + int(c), have[1] + int(n))
    return rows


def paired_difference(
    a: ModelRow, b: ModelRow, *, confidence: float, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0
) -> dict[str, Any] | None:
    """The difference of held-out resolve rates, a minus b, over the (seed, task) pairs both
    evaluated, with a percentile bootstrap interval that resamples tasks (each with all of its
    seeds, so a task's difficulty is not counted as independent evidence once per seed);
    None when they share no task."""
    common = sorted(set(a.per_task) & set(b.per_task))
    common = [k for k in common if a.per_task[k][1] and b.per_task[k][1]]
    if not common:
        return None

    def rate(row: ModelRow, key: tuple[int, str]) -> float:
        c, n = row.per_task[key]
        return c / n

    diffs: dict[str, list[float]] = {}
    for key in common:
        diffs.setdefault(key[1], []).append(rate(a, key) - rate(b, key))
    tasks = sorted(diffs)
    total = [sum(diffs[t]) for t in tasks]
    count = [len(diffs[t]) for t in tasks]
    point = sum(total) / sum(count)
    draw = random.Random(seed)
    estimates = []
    for _ in range(samples):
        picks = [draw.randrange(len(tasks)) for _ in tasks]
        estimates.append(sum(total[i] for i in picks) / sum(count[i] for i in picks))
    estimates.sort()
    tail = (1 - confidence) / 2
    low = estimates[max(0, math.floor(tail * samples))]
    high = estimates[min(samples - 1, math.ceil((1 - tail) * samples) - 1)]
    wins = sum(rate(a, k) > rate(b, k) for k in common)
    losses = sum(rate(a, k) < rate(b, k) for k in common)
    return {
        "difference": point,
        "interval": [low, high],
        "pairs": len(common),
        "tasks": len(tasks),
        "a_better": wins,
        "b_better": losses,
    }


def _rl_lines(run: Path) -> dict[str, dict[str, Any]]:
    """The RL stage's lines of a run (``rl``, and ``rl-base`` for RL from base)."""
    done = _done(run, "rl")
    if not done:
        return {}
    lines = {"rl": done}
    if isinstance(done.get("from_base"), dict):
        lines["rl-base"] = done["from_base"]
    return lines


def rl_figures(experiment: Experiment, out: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (arm, RL line): the reward mean of each step per seed, and the rollouts and the
    groups with signal summed over seeds."""
    figures: dict[tuple[str, str], dict[str, Any]] = {}
    for arm in experiment.arms:
        for seed in experiment.seeds:
            for line, done in _rl_lines(out / arm.name / f"seed-{seed}").items():
                entry = figures.setdefault(
                    (arm.name, line), {"curves": {}, "rollouts": 0, "groups": 0, "kept": 0}
                )
                entry["curves"][seed] = [
                    (int(s["step"]), s.get("reward_mean")) for s in done.get("steps", [])
                ]
                groups = done.get("groups", [])
                entry["rollouts"] += sum(int(g.get("rollouts", 0)) for g in groups)
                entry["groups"] += len(groups)
                entry["kept"] += sum(bool(g.get("kept")) for g in groups)
    return figures


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _signed(value: float) -> str:
    return f"{100 * value:+.1f}"


def _model_figures(
    row: ModelRow, label: str, confidence: float, domain: str | None = None
) -> dict[str, Any]:
    """One line of the held-out table: per seed, pooled with its interval, across seeds."""
    rates = row.rates()
    figures: dict[str, Any] = {
        "arm": row.arm,
        "model": label,
        "per_seed": {str(s): list(v) for s, v in sorted(row.per_seed.items())},
        "resolved": row.resolved,
        "attempts": row.attempts,
        "rate": row.resolved / row.attempts if row.attempts else None,
        "interval": list(wilson_interval(row.resolved, row.attempts, confidence)),
        "seed_mean": mean(rates) if rates else None,
        "seed_sd": stdev(rates) if len(rates) > 1 else None,
        "seed_range": [min(rates), max(rates)] if rates else None,
    }
    if domain is not None:
        figures["domain"] = domain
    return figures


def write_experiment_report(experiment: Experiment, out: Path, *, source: str = "") -> Path:
    """``<out>/report/experiment.md`` and ``experiment.json`` (with PNG plots where matplotlib
    is installed) from the runs that finished; returns the Markdown's path."""
    folder = out / "report"
    folder.mkdir(parents=True, exist_ok=True)
    rows = collect_rows(experiment, out)
    rl = rl_figures(experiment, out)
    timings = _read_timings(out)
    confidence = experiment.confidence
    level = f"{round(100 * confidence)}%"
    models: list[dict[str, Any]] = []
    for (_, model), row in rows.items():
        models.append(_model_figures(row, model, confidence))
        # A run on two domains: each domain's held-out tasks on rows of their own too.
        domains = sorted({task_domain(task) for _, task in row.per_task})
        if len(domains) > 1:
            for domain in domains:
                label = f"{model} ({domain} tasks)"
                models.append(_model_figures(row.of_domain(domain), label, confidence, domain))
    comparisons: list[dict[str, Any]] = []
    for comparison in experiment.comparisons:
        entry: dict[str, Any] = {"name": comparison.name, "a": comparison.a, "b": comparison.b,
                                 "metric": comparison.metric}  # fmt: skip
        a_key = tuple(comparison.a.split("/", 1))
        b_key = tuple(comparison.b.split("/", 1))
        if comparison.domain is not None:
            entry["domain"] = comparison.domain
        if comparison.metric == "held-out":
            a_row, b_row = rows.get(a_key), rows.get(b_key)  # type: ignore[arg-type]
            if comparison.domain is not None:
                a_row = a_row and a_row.of_domain(comparison.domain)
                b_row = b_row and b_row.of_domain(comparison.domain)
            result = (
                paired_difference(a_row, b_row, confidence=confidence)
                if a_row is not None and b_row is not None
                else None
            )
            entry["result"] = result
            if result is None:
                entry["verdict"] = "not measured: a side has no finished evaluation"
            elif result["interval"][0] > 0:
                entry["verdict"] = f"{comparison.a} better"
            elif result["interval"][1] < 0:
                entry["verdict"] = f"{comparison.b} better"
            else:
                entry["verdict"] = "no clear difference"
        else:
            sides = {}
            for side, key in (("a", a_key), ("b", b_key)):
                figure = rl.get(key)  # type: ignore[arg-type]
                sides[side] = (
                    None
                    if not figure or not figure["rollouts"]
                    else {
                        "kept_groups": figure["kept"],
                        "groups": figure["groups"],
                        "rollouts": figure["rollouts"],
                        "per_1000": 1000 * figure["kept"] / figure["rollouts"],
                    }
                )
            entry["result"] = sides
            entry["verdict"] = (
                "not measured: a side ran no RL"
                if None in sides.values()
                else f"{sides['a']['per_1000']:.1f} vs {sides['b']['per_1000']:.1f} groups with "  # type: ignore[index]
                "signal per 1,000 rollouts"
            )
        comparisons.append(entry)
    curves = {
        f"{arm}/{line}": {str(seed): points for seed, points in figure["curves"].items()}
        for (arm, line), figure in rl.items()
    }
    data = {
        "experiment": experiment.name,
        "source": source,
        "seeds": experiment.seeds,
        "confidence": confidence,
        "arms": [
            {"name": a.name, "about": a.about, "settings": a.settings} for a in experiment.arms
        ],
        "models": models,
        "comparisons": comparisons,
        "rl": {
            f"{arm}/{line}": {k: v for k, v in figure.items() if k != "curves"}
            for (arm, line), figure in rl.items()
        },
        "curves": curves,
        "seconds": timings,
    }
    write_json(folder / "experiment.json", data)
    plots = _plots(folder, models, rl, level)
    lines = [f"# Experiment {experiment.name}", ""]
    if source:
        lines += [f"Regenerate: `orchard experiment run {source}` (runs what is missing, then "
                  f"this report); `orchard experiment report {source}` rewrites the report "
                  "alone.", ""]  # fmt: skip
    lines += [
        f"Seeds {', '.join(map(str, experiment.seeds))}; every interval is {level}. "
        "Held-out resolve rates pool the seeds (Wilson interval over all attempts); the "
        "spread is across seeds (each seed trains anew on the same tasks).",
        "",
        "## Arms",
        "",
        "| arm | what it is | settings |",
        "|---|---|---|",
    ]
    for spec in experiment.arms:
        settings = json.dumps(spec.settings, sort_keys=True) if spec.settings else "the recipe"
        lines.append(f"| {spec.name} | {spec.about or '-'} | `{settings}` |")
    lines += [
        "",
        "## Held-out resolve rate",
        "",
        f"| arm | model | per seed | pooled | {level} interval | mean across seeds (sd) | range |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in models:
        per_seed = ", ".join(f"{r}/{n}" for r, n in m["per_seed"].values())
        pooled = (
            "-" if m["rate"] is None else f"{m['resolved']}/{m['attempts']} ({_pct(m['rate'])})"
        )
        low, high = m["interval"]
        spread = (
            "-"
            if m["seed_mean"] is None
            else _pct(m["seed_mean"]) + ("" if m["seed_sd"] is None else f" ({_pct(m['seed_sd'])})")
        )
        span = (
            "-"
            if m["seed_range"] is None
            else f"{_pct(m['seed_range'][0])} to {_pct(m['seed_range'][1])}"
        )
        lines.append(
            f"| {m['arm']} | {m['model']} | {per_seed} | {pooled} | {_pct(low)} to {_pct(high)} "
            f"| {spread} | {span} |"
        )
    if "held-out" in plots:
        lines += ["", f"![held-out resolve rate]({plots['held-out']})"]
    if comparisons:
        lines += [
            "",
            "## Comparisons",
            "",
            "Held-out comparisons are paired: the same tasks and seeds, the difference of "
            f"resolve rates in points with a {level} bootstrap interval over tasks.",
            "",
            "| comparison | a | b | difference (points) | interval | verdict |",
            "|---|---|---|---|---|---|",
        ]
        for c in comparisons:
            result = c["result"]
            if c["metric"] == "held-out" and result:
                diff = _signed(result["difference"])
                interval = f"{_signed(result['interval'][0])} to {_signed(result['interval'][1])}"
            else:
                diff, interval = "-", "-"
            name = f"{c['name']} ({c['domain']} tasks)" if c.get("domain") else c["name"]
            lines.append(f"| {name} | {c['a']} | {c['b']} | {diff} | {interval} | {c['verdict']} |")
        flat = [c["name"] for c in comparisons if c["verdict"] == "no clear difference"]
        if flat:
            lines += ["", "Did not show a difference: " + "; ".join(flat) + "."]
    if rl:
        lines += [
            "",
            "## RL",
            "",
            "| arm / line | rollouts | groups | with signal | with signal per 1,000 rollouts |",
            "|---|---|---|---|---|",
        ]
        for (arm, line), figure in rl.items():
            per = 1000 * figure["kept"] / figure["rollouts"] if figure["rollouts"] else 0.0
            lines.append(
                f"| {arm} / {line} | {figure['rollouts']} | {figure['groups']} | {figure['kept']} "
                f"| {per:.1f} |"
            )
        if "rl-reward" in plots:
            lines += ["", f"![RL reward per step]({plots['rl-reward']})"]
    lines += ["", "## Runs", ""]
    for spec in experiment.arms:
        for seed in experiment.seeds:
            run = out / spec.name / f"seed-{seed}"
            name = f"{spec.name}/seed-{seed}"
            if not (run / "report" / "report.md").exists():
                lines.append(f"- {name}: not finished")
                continue
            took = timings.get(name)
            shared = _shared_note(run)
            lines.append(
                f"- [{name}](../{name}/report/report.md)"
                + (f", {took:.0f} s" if took is not None else "")
                + (f"; {shared}" if shared else "")
            )
    if "note" in plots:
        lines += ["", plots["note"]]
    path = folder / "experiment.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _shared_note(run: Path) -> str:
    try:
        shared = json.loads((run / SHARED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    parts = [f"{s} from {w}" for s, w in shared.get("stages", {}).items()]
    parts += [f"{m} evaluation from {w}" for m, w in shared.get("evaluations", {}).items()]
    return "copied: " + ", ".join(parts) if parts else ""


def _plots(
    folder: Path,
    models: Sequence[dict[str, Any]],
    rl: Mapping[tuple[str, str], dict[str, Any]],
    level: str,
) -> dict[str, str]:
    """The plots beside the report, by name; "note" says why there are none."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return {"note": "Plots need matplotlib (the `report` extra); this report has tables only."}
    made: dict[str, str] = {}
    shown = [m for m in models if m["rate"] is not None]
    if shown:
        fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(shown) + 2), 3.6))
        xs = list(range(len(shown)))
        rates = [m["rate"] for m in shown]
        below = [m["rate"] - m["interval"][0] for m in shown]
        above = [m["interval"][1] - m["rate"] for m in shown]
        ax.bar(xs, rates, color="#8fb3d9", yerr=[below, above], capsize=4, label=f"pooled, {level}")
        for x, m in zip(xs, shown, strict=True):
            seeds = [r / n for r, n in m["per_seed"].values() if n]
            ax.scatter([x] * len(seeds), seeds, color="#1f3b5c", s=12, zorder=3)
        ax.set_xticks(xs, [f"{m['arm']}\n{m['model']}" for m in shown], fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_ylabel("held-out resolve rate")
        ax.set_title("Held-out resolve rate (bars: pooled; dots: seeds)", fontsize=9)
        fig.tight_layout()
        fig.savefig(folder / "held-out.png", dpi=110)
        plt.close(fig)
        made["held-out"] = "held-out.png"
    if any(figure["curves"] for figure in rl.values()):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for (arm, line), figure in rl.items():
            by_step: dict[int, list[float]] = {}
            for points in figure["curves"].values():
                for step, value in points:
                    if value is not None:
                        by_step.setdefault(step, []).append(value)
            if not by_step:
                continue
            steps = sorted(by_step)
            centre = [mean(by_step[s]) for s in steps]
            (drawn,) = ax.plot(steps, centre, label=f"{arm} / {line}")
            ax.fill_between(
                steps,
                [min(by_step[s]) for s in steps],
                [max(by_step[s]) for s in steps],
                color=drawn.get_color(),
                alpha=0.15,
            )
        ax.set_xlabel("RL step")
        ax.set_ylabel("mean reward of the step's rollouts")
        ax.set_title("RL reward: mean over seeds, band from the lowest to the highest", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / "rl-reward.png", dpi=110)
        plt.close(fig)
        made["rl-reward"] = "rl-reward.png"
    return made
