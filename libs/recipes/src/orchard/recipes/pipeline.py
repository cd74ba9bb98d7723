"""Running a recipe: its stages in order against running services, resumable, ending in a report.

`run_recipe` prepares the tasks, then runs each enabled stage that has not finished yet (a
stage is finished when its ``done.json`` exists, see `orchard.recipes.workspace`), and writes
the report (``report/report.md`` with PNG plots, ``report/report.json``) from what the stages
left in the run folder. ``only`` runs the named stages alone (their inputs must exist).
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from orchard.recipes.preflight import check_recipe
from orchard.recipes.recipe_tasks import prepare_tasks
from orchard.recipes.rerank import rerank_report, run_rerank
from orchard.recipes.rubric import rubric_report
from orchard.recipes.stages import (
    StageContext,
    run_collect,
    run_credit,
    run_curate,
    run_evaluate,
    run_rl,
    run_sft,
)
from orchard.recipes.trails import report_trails
from orchard.recipes.workspace import RunDir, StackEndpoints, write_json
from orchard.sdk.recipe import STAGES, Recipe
from orchard.sdk.report import (
    Curve,
    GroupStats,
    HarnessEvaluation,
    ModelEvaluation,
    RlRun,
    RlStep,
    RunReport,
    ServiceStats,
    TrailLink,
    TrajectoryCounts,
    service_stats_from_metrics,
    write_report,
)

__all__ = ["StageError", "build_report", "run_recipe"]

log = logging.getLogger(__name__)

RUNNERS: dict[str, Callable[[StageContext], dict[str, Any]]] = {
    "collect": run_collect,
    "credit": run_credit,
    "curate": run_curate,
    "sft": run_sft,
    "rl": run_rl,
    "evaluate": run_evaluate,
    "rerank": run_rerank,
}


class StageError(RuntimeError):
    """A stage failed; the message names it and what to look at."""


def _needs(stage: str) -> list[str]:
    return {
        "credit": ["collect"],
        "curate": ["collect"],
        "sft": ["curate"],
        "evaluate": [],
        "rerank": ["evaluate"],
        "rl": [],
        "collect": [],
    }[stage]


def run_recipe(
    recipe: Recipe,
    stack: StackEndpoints,
    *,
    only: Sequence[str] = (),
    progress: bool = True,
    workers: int = 4,
    seed: int = 0,
    say: Callable[[str], None] = print,
) -> Path:
    """Run the recipe's stages (or ``only`` those) and write the report; returns its path."""
    unknown = [s for s in only if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}: the stages are {', '.join(STAGES)}")
    if recipe.student.engine != "local":
        raise ValueError(
            f"student.engine {recipe.student.engine!r}: orchard-rollout samples the student on "
            "the engine its own configuration names (job_policies.engine.type: local or vllm); "
            "set vllm there and keep student.engine: local in the recipe"
        )
    check_recipe(recipe, stack)
    run = RunDir.open(recipe)
    run.claim_seed(seed)
    ctx = StageContext(
        recipe=recipe,
        run=run,
        stack=stack,
        tasks=prepare_tasks(
            recipe, run, stack.artifact_store() if recipe.tasks.generated else None
        ),
        progress=progress,
        workers=workers,
        seed=seed,
    )
    sizes = ", ".join(f"{k} {len(v)}" for k, v in ctx.tasks.items())
    say(f"recipe {recipe.name}: tasks {sizes}; outputs in {run.root}")
    chosen = list(only) or recipe.stages.enabled()
    for stage in [s for s in STAGES if s in chosen]:
        if run.done(stage) is not None and stage not in only:
            say(f"stage {stage}: done already (remove {run.root / stage} to run it again)")
            continue
        missing = [n for n in _needs(stage) if run.done(n) is None]
        if missing:
            raise StageError(
                f"stage {stage} needs the output of {', '.join(missing)}; run that stage first"
            )
        if stage in only:
            run.reset(stage)
        started = time.monotonic()
        try:
            summary = RUNNERS[stage](ctx)
        except Exception as exc:
            raise StageError(
                f"stage {stage} failed: {type(exc).__name__}: {exc}; its outputs so far are in "
                f"{run.root / stage}, and running the recipe again resumes here"
            ) from exc
        summary["seconds"] = round(time.monotonic() - started, 1)
        run.finish(stage, summary)
        say(f"stage {stage}: done in {summary['seconds']:.0f} s")
    report = build_report(ctx)
    return write_report(report, run.root / "report")


def _curve(name: str, points: Sequence[tuple[float, float]]) -> Curve | None:
    points = [(s, v) for s, v in points if not math.isnan(v)]  # NaN: no value that step
    if not points:
        return None
    return Curve(name, tuple(p[0] for p in points), tuple(p[1] for p in points))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _service_stats(stack: StackEndpoints) -> ServiceStats | None:
    if not stack.env_metrics:
        return None
    try:
        with urllib.request.urlopen(f"http://{stack.env_metrics}/metrics", timeout=5) as reply:
            return service_stats_from_metrics(reply.read().decode())
    except OSError as exc:
        log.warning("the environment service's metrics are unreachable: %s", exc)
        return None


def _domains(ctx: StageContext, by_domain: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """A joint run's held-out attempts per domain, (resolved, attempts) each; none for a run of
    one domain (the whole table says it)."""
    if len(ctx.recipe.tasks.domains) < 2:
        return {}
    return {d: (int(v["resolved"]), int(v["attempts"])) for d, v in sorted(by_domain.items())}


def _harness_evaluations(
    ctx: StageContext, by_harness: dict[str, dict[str, Any]]
) -> tuple[HarnessEvaluation, ...]:
    """A model's per-harness rows from the evaluate stage's ``by_harness`` (none in a run from
    before it was recorded), in the recipe's order: its own harnesses, then the held-out ones."""
    k = ctx.recipe.stages.evaluate.attempts_per_task
    order = {h: i for i, h in enumerate(ctx.recipe.evaluated_harnesses)}
    rows = [
        HarnessEvaluation(
            harness=harness,
            resolved=int(entry["resolved"]),
            attempts=int(entry["attempts"]),
            held_out=bool(entry.get("held_out", False)),
            excluded=int(entry.get("excluded", 0)),
            k=k,
            tasks={task: (int(n), int(c)) for task, (n, c) in entry.get("tasks", {}).items()},
        )
        for harness, entry in by_harness.items()
    ]
    return tuple(sorted(rows, key=lambda row: (order.get(row.harness, len(order)), row.harness)))


def _sft_validation_note(sft: dict[str, Any]) -> str | None:
    """Which SFT step the run handed on and why: the lowest validation loss, on held-out tasks."""
    validation = sft.get("validation")
    if not validation:
        return None
    if "off" in validation:
        return f"SFT ran without validation ({validation['off']}): its last step is handed on"
    if not validation["points"]:
        return None
    tasks = len(validation["held_out_tasks"])
    note = (
        f"SFT handed on step {validation['best_step']} of {sft['steps']} (epoch "
        f"{validation['best_epoch']:.3g}): the lowest validation loss, "
        f"{validation['best_loss']:.4g}, on {tasks} held-out task(s) "
        f"({validation['trajectories']} trajectories, {validation['samples']} samples)"
    )
    if validation["stopped_early"]:
        note += f"; early stopping ended SFT after step {sft['steps']}"
    return note


def _trails(ctx: StageContext, models: Sequence[str]) -> tuple[TrailLink, ...]:
    """The screenshot trail pages of a few evaluated GUI episodes per model, written into the
    report folder; none when the evaluation kept no trails (`orchard.recipes.trails`)."""
    try:
        store = ctx.stack.artifact_store() if ctx.stack.artifacts else None
    except Exception as exc:  # a store this machine cannot open: the report goes on without
        log.warning("GUI trails left out of the report: %s", exc)
        store = None
    return report_trails(
        ctx.run.root / "evaluate", models, ctx.pass_mark, ctx.run.root / "report", store=store
    )


def gui_notes(recipe: Recipe) -> list[str]:
    """What a GUI run's report says plainly: how the models perceived the pages and what
    judged the episodes."""
    if recipe.tasks.gui is None:
        return []
    notes = []
    if "builtin:browser-text" in recipe.evaluated_harnesses:
        notes.append(
            "builtin:browser-text: the student reads each page as text (its elements with role, "
            "name, value and the point a click hits), in place of the screenshot's pixels"
        )
    if "builtin:browser" in recipe.evaluated_harnesses:
        notes.append("builtin:browser: the student sees each page as a screenshot")
    notes.append(
        "GUI episodes are scored by orchard-reward's built-in state judge, which reads each "
        "site's server-side state (no model reads the screenshots)"
    )
    return notes


DISTILL_KL = "distill_reverse_kl"
"""The trainer's per-step reverse-KL estimate of on-policy distillation (`StepMetrics.extra`)."""


def _rate(result: dict[str, Any]) -> str:
    attempts = int(result["attempts"])
    rate = result["resolved"] / attempts if attempts else 0.0
    return f"{rate:.1%} ({result['resolved']}/{attempts})"


def teacher_words(teacher: dict[str, Any], evaluated: dict[str, Any] | None) -> str:
    """The OPD teacher as the report names it: model, how it was trained, its SFT losses and,
    when the evaluate stage ran it, its held-out resolve rate."""
    words = f"{teacher['model']}, {teacher['trained']}"
    weights = teacher.get("weights") or {}
    if weights:
        words += f"; published as {teacher.get('registry_model', '?')} {weights['version']}"
    if teacher.get("first_loss") is not None:
        words += (
            f"; SFT loss {teacher['first_loss']:.4g} to {teacher['last_loss']:.4g} over "
            f"{teacher['steps']} steps"
        )
    validation = teacher.get("validation") or {}
    if validation.get("best_loss") is not None:
        words += (
            f", validation loss {validation['best_loss']:.4g} at step {validation['best_step']} "
            f"on {len(validation['held_out_tasks'])} held-out task(s)"
        )
    if evaluated:
        words += f"; held-out resolve rate (as opd-teacher) {_rate(evaluated)}"
    else:
        words += "; not evaluated on the held-out tasks"
    return words


def rl_verdict(estimator: str, models: dict[str, Any], updates: int | None = None) -> str:
    """What RL did to the held-out resolve rate, from the evaluate stage's numbers, said
    plainly; with OPD, set beside the teacher's (OPD can only move the student toward it).
    ``updates``: the RL steps that published a version (None: not known)."""
    rl = models.get("rl")
    start_name = "sft" if "sft" in models else "base"
    start = models.get(start_name)
    if rl is None or start is None:
        return ""
    name = "OPD" if estimator == "opd" else f"RL ({estimator})"
    before = start["resolved"] / start["attempts"] if start["attempts"] else 0.0
    after = rl["resolved"] / rl["attempts"] if rl["attempts"] else 0.0
    change = (after - before) * 100
    if rl.get("same_weights_as") == start_name:
        why = (
            "no RL step updated the model: no group carried signal"
            if updates == 0
            else "no RL version did better in validation"
        )
        verdict = (
            f"{name} handed on the {start_name} model's weights unchanged ({why}): held-out "
            f"resolve rate {_rate(rl)}, as before"
        )
    elif abs(change) < 1e-9:
        verdict = (
            f"{name} left the held-out resolve rate where it was: {_rate(start)} "
            f"({start_name}) and {_rate(rl)} (rl)"
        )
    else:
        verdict = (
            f"{name} {'raised' if change > 0 else 'lowered'} the held-out resolve rate from "
            f"{_rate(start)} ({start_name}) to {_rate(rl)} (rl), {change:+.1f} points"
        )
    teacher = models.get("opd-teacher")
    if estimator == "opd" and teacher is not None:
        taught = teacher["resolved"] / teacher["attempts"] if teacher["attempts"] else 0.0
        verdict += f"; the teacher resolves {_rate(teacher)}, " + (
            f"above the {start_name} model: a better model for OPD to move the student toward"
            if taught > before
            else f"no better than the {start_name} model: OPD can only move the student "
            "toward it, so it has nothing to gain here"
        )
    return verdict + "."


def rl_run(recipe: Recipe, rl: dict[str, Any], models: dict[str, Any]) -> RlRun:
    """The report's RL section from the rl stage's summary and the evaluate stage's models."""
    estimator = str(rl.get("estimator", recipe.stages.rl.estimator))
    teacher = (rl.get("distillation") or {}).get("teacher")
    sampler = recipe.stages.rl.sampler
    return RlRun(
        estimator=estimator,
        sampler=f"{sampler.kind}, n {sampler.n}, {recipe.stages.rl.groups_per_step} group(s) "
        "per step",
        steps=tuple(
            RlStep(
                step=int(s["step"]),
                rollouts=int(s.get("rollouts_run_by_job", s.get("rollouts", 0))),
                reward_mean=s.get("reward_mean"),
                loss=s.get("loss"),
                distill_reverse_kl=s.get("metrics", {}).get(DISTILL_KL),
                published=s.get("published"),
            )
            for s in rl.get("steps", [])
        ),
        teacher=teacher_words(teacher, models.get("opd-teacher")) if teacher else "",
        verdict=rl_verdict(
            estimator, models, sum(bool(s.get("published")) for s in rl.get("steps", []))
        ),
    )


def build_report(ctx: StageContext) -> RunReport:
    run = ctx.run
    evaluations = []
    evaluate = run.done("evaluate")
    # done.json keeps its keys sorted
    order = {"base": 0, "sft": 1, "rl": 2, "rl-base": 3, "opd-teacher": 4}
    found = (evaluate or {}).get("models", {})
    for name, result in sorted(found.items(), key=lambda item: order.get(item[0], 3)):
        weights = result.get("weight_version", "")
        if result.get("same_weights_as"):
            weights = f"{weights} (the {result['same_weights_as']} model's)"
        evaluations.append(
            ModelEvaluation(
                name,
                result["resolved"],
                result["attempts"],
                weights,
                _harness_evaluations(ctx, result.get("by_harness", {})),
                _domains(ctx, result.get("by_domain", {})),
            )
        )
    curves = []
    sft_log = _jsonl(run.root / "sft" / "run.jsonl")
    for key, label in (("loss", "sft loss"), ("validation_loss", "sft validation loss")):
        points = [(float(r["step"]), float(r[key])) for r in sft_log if key in r]
        curve = _curve(label, points)
        if curve:
            curves.append(curve)
    rl = run.done("rl") or {}
    steps = rl.get("steps", [])
    from_base = rl.get("from_base") or {}
    for line, prefix in ((steps, "rl"), (from_base.get("steps", []), "rl from base")):
        for key, label in (("reward_mean", "reward mean"), ("loss", "loss")):
            points = [(float(s["step"]), float(s[key])) for s in line if s.get(key) is not None]
            curve = _curve(f"{prefix} {label}", points)
            if curve:
                curves.append(curve)
        points = [
            (float(s["step"]), float(s["metrics"][DISTILL_KL]))
            for s in line
            if DISTILL_KL in s.get("metrics", {})
        ]
        curve = _curve(f"{prefix} distill reverse KL", points)
        if curve:
            curves.append(curve)
    groups = []
    if rl.get("groups"):
        every = rl["groups"]
        kept = [g for g in every if g["kept"]]
        groups.append(
            GroupStats(
                sampler=ctx.recipe.stages.rl.sampler.kind,
                groups=len(every),
                rollouts=sum(g["rollouts"] for g in every),
                kept_groups=len(kept),
                mean_positive_fraction=(
                    sum(g["positive_fraction"] for g in kept) / len(kept) if kept else 0.0
                ),
                choices=dict(Counter(g["choice"] for g in every)),
            )
        )
    collect = run.done("collect") or {}
    credit = run.done("credit") or {}
    excluded = Counter(collect.get("excluded", {}))
    excluded.update({f"credit: {k}": v for k, v in credit.get("excluded", {}).items()})
    counts = TrajectoryCounts(
        resolved=collect.get("resolved", 0),
        unresolved=collect.get("unresolved", 0),
        credit_assigned=credit.get("credited", 0),
        excluded=dict(excluded),
    )
    seconds = {s: float(d["seconds"]) for s in STAGES if (d := run.done(s)) and "seconds" in d}
    notes = list(ctx.notes)
    notes += gui_notes(ctx.recipe)
    sft_note = _sft_validation_note(run.done("sft") or {})
    if sft_note:
        notes.append(sft_note)
    if rl.get("note"):
        notes.append(rl["note"])
    if from_base.get("note"):
        notes.append(f"RL from base: {from_base['note']}")
    notes += [f"RL step {s['step']}: {s['curriculum']}" for s in steps if s.get("curriculum")]
    notes += [
        f"RL from base, step {s['step']}: {s['curriculum']}"
        for s in from_base.get("steps", [])
        if s.get("curriculum")
    ]
    if credit.get("note"):
        notes.append(credit["note"])
    curate = run.done("curate")
    if curate:
        notes.append(f"curation kept {curate['kept']} of {curate['input']} teacher trajectories")
    trails = _trails(ctx, [e.model for e in evaluations])
    services = _service_stats(ctx.stack)
    if services is None:
        notes.append(
            "no sandbox numbers: orchard-env's metrics were not reachable (give it "
            "server.metrics_address, e.g. `orchard up --set server.metrics_address=127.0.0.1:9464`)"
        )
    report = RunReport(
        title=f"Recipe {ctx.recipe.name}",
        rl=rl_run(ctx.recipe, rl, found) if rl else None,
        evaluations=tuple(evaluations),
        curves=tuple(curves),
        groups=tuple(groups),
        trajectories=counts,
        services=services,
        stage_seconds=seconds,
        confidence=ctx.recipe.stages.evaluate.confidence,
        notes=tuple(notes),
        trails=trails,
        rerank=rerank_report(run.done("rerank")),
        rubric=rubric_report(rl),
    )
    models = (evaluate or {}).get("models", {})
    write_json(
        run.root / "report" / "families.json",
        {name: result.get("by_family", {}) for name, result in models.items()},
    )
    return report
