"""The rerank stage: best-of-k at evaluation by a value model trained on earlier policies.

The history is what earlier policies did: this run's teacher trajectories (collect), its RL
steps' groups and validation runs (rl, both lines of weights), optionally the other models'
held-out attempts (evaluate), and the same from the run folders of earlier runs
(`Rerank.history`). Rollouts of the reranked model's own weights are never in it, wherever
they come from, and scored ones only (an excluded rollout has no outcome to learn). A
`orchard.recipes.value_model` is measured on whole tasks held out of the history, then
refitted on all of it.

The reranked model (by default the run's last, RL if there is one) then makes ``k`` attempts
at every held-out task on every evaluated harness, through the evaluate stage's rollout path
at its temperature (its own attempts, when it made at least ``k``). Over the (task, harness)
pairs with ``k`` scored attempts the stage reports, each a share of the pairs:

- pass@1: the first attempt (in a fixed order) succeeded;
- random-of-k: the expected success of one attempt picked uniformly, i.e. c / k per pair;
- value-reranked: the attempt the value model scores highest succeeded (tied top scores:
  their mean success);
- oracle pass@k: any of the k succeeded, the most any picker could get.

And the value model's AUC on those attempts: trained on earlier policies, read on the new
one's trajectories (the distribution shift).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from orchard.recipes.stages import (
    FROM_BASE,
    StageContext,
    _evaluate_model,
    derived_seed,
    models_to_evaluate,
)
from orchard.recipes.trails import main_line
from orchard.recipes.value_model import (
    FeatureSpace,
    auc,
    fit_value_model,
    split_by_task,
    within_task_accuracy,
)
from orchard.recipes.workspace import write_json
from orchard.sdk.report import RerankFigure, Reranking
from orchard.types.v1 import reward_pb2, trajectory_pb2

__all__ = [
    "FIGURES",
    "HistoryError",
    "HistoryRow",
    "best_of_k",
    "read_history",
    "rerank_report",
    "run_rerank",
    "verdict",
]

log = logging.getLogger(__name__)

FIGURES = ("pass@1", "random-of-k", "value-reranked", "oracle pass@k")
"""The four numbers, in the order the report shows them."""


class HistoryError(ValueError):
    """A history run folder is missing or unreadable."""


@dataclass(frozen=True)
class HistoryRow:
    """One scored trajectory of an earlier policy and where it came from."""

    trajectory: trajectory_pb2.Trajectory
    source: str
    """e.g. "this run: collect", "runs/first: rl"."""


def _scored(trajectory: trajectory_pb2.Trajectory) -> bool:
    return trajectory.reward.status == reward_pb2.REWARD_STATUS_SCORED


def _versions(trajectory: trajectory_pb2.Trajectory) -> set[str]:
    """The weight versions that sampled the trajectory's turns."""
    found = {t.weight_version for t in trajectory.turns if t.weight_version}
    found.update(v for v in trajectory.metadata.get("weight_versions", "").split(",") if v)
    return found


def _group_files(
    run: Path, sources: Sequence[str], skip: Collection[str]
) -> list[tuple[str, Path]]:
    """(source, file) of the groups a run folder holds for ``sources``; evaluate files of the
    models named in ``skip`` are left out."""
    files: list[tuple[str, Path]] = []
    if "collect" in sources:
        files.append(("collect", run / "collect" / "groups.jsonl"))
    if "rl" in sources:
        for line in (run / "rl", run / "rl" / FROM_BASE):
            files.append(("rl", line / "groups.jsonl"))
            files += [("rl", p) for p in sorted((line / "validation").glob("*.groups.jsonl"))]
    if "evaluate" in sources:
        for path in sorted((run / "evaluate").glob("*.groups.jsonl")):
            if path.name.removesuffix(".groups.jsonl") not in skip:
                files.append(("evaluate", path))
    return [(s, p) for s, p in files if p.is_file()]


def _read_groups(path: Path) -> list[trajectory_pb2.TrajectoryGroup]:
    groups = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            groups.append(json_format.Parse(line, trajectory_pb2.TrajectoryGroup()))
        except json_format.ParseError as exc:
            raise HistoryError(f"{path}, line {number}: not a trajectory group: {exc}") from exc
    return groups


def read_history(
    runs: Sequence[tuple[str, Path]],
    sources: Sequence[str],
    *,
    exclude_versions: set[str],
    skip_models: Collection[str] = (),
) -> list[HistoryRow]:
    """The scored main-line trajectories of ``sources`` in each (label, folder) of ``runs``,
    without those sampled by any of ``exclude_versions``, each once. Raises HistoryError for a
    folder that is missing or holds none of the sources' files."""
    rows: list[HistoryRow] = []
    seen: set[str] = set()
    for label, folder in runs:
        if not folder.is_dir():
            raise HistoryError(f"history run {label}: {folder} is not a folder")
        files = _group_files(folder, sources, skip_models)
        if not files and label != "this run":
            raise HistoryError(
                f"history run {label}: {folder} holds none of the rollouts of "
                f"{', '.join(sources)} (collect/groups.jsonl, rl/groups.jsonl, "
                "evaluate/*.groups.jsonl): is it a recipe run's folder?"
            )
        for source, path in files:
            for group in _read_groups(path):
                for trajectory in main_line(group):
                    key = trajectory.id or trajectory.rollout_id
                    if not _scored(trajectory) or (key and key in seen):
                        continue
                    if _versions(trajectory) & exclude_versions:
                        continue
                    seen.add(key)
                    rows.append(HistoryRow(trajectory, f"{label}: {source}"))
    return rows


# -- the four figures ----------------------------------------------------------------------------


def best_of_k(pairs: Mapping[str, Sequence[tuple[bool, float | None]]], k: int) -> dict[str, Any]:
    """The four figures over ``pairs`` ((task, harness) key -> its scored attempts in a fixed
    order, each (succeeded, value-model score or None)); the first ``k`` of each are used and
    a pair with fewer is left out and counted. Each figure is {"successes", "tasks"}: a sum of
    per-pair values in [0, 1] over the pairs used; value-reranked is None when any score is
    missing (no value model)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    used = {key: list(a[:k]) for key, a in pairs.items() if len(a) >= k}
    first = random = reranked = oracle = 0.0
    scored = all(score is not None for a in used.values() for _, score in a)
    for attempts in used.values():
        won = [1.0 if w else 0.0 for w, _ in attempts]
        first += won[0]
        random += sum(won) / k
        oracle += max(won)
        if scored:
            top = max(float(s) for _, s in attempts if s is not None)
            tied = [w for w, (_, s) in zip(won, attempts, strict=True) if s == top]
            reranked += sum(tied) / len(tied)
    n = len(used)

    def figure(successes: float) -> dict[str, Any]:
        return {"successes": successes, "tasks": n}

    return {
        "k": k,
        "tasks": n,
        "tasks_short": len(pairs) - n,
        "figures": {
            "pass@1": figure(first),
            "random-of-k": figure(random),
            "value-reranked": figure(reranked) if scored else None,
            "oracle pass@k": figure(oracle),
        },
    }


def verdict(summary: Mapping[str, Any]) -> str:
    """What the figures say about reranking, in plain words."""
    figures = summary["figures"]
    n = summary["tasks"]
    if not n:
        return f"no held-out task had {summary['k']} scored attempts: nothing to compare"
    rate = {name: f["successes"] / n for name, f in figures.items() if f is not None}
    headroom = rate["oracle pass@k"] - rate["random-of-k"]
    if figures["value-reranked"] is None:
        reason = str(summary["value_model"].get("reason", "it was not trained"))
        return f"no value model, so no reranking: {reason}"
    delta = rate["value-reranked"] - rate["random-of-k"]
    if headroom <= 1e-12:
        return (
            f"reranking could not help: on no task did the {summary['k']} attempts mix "
            "successes and failures, so every pick gives the same result (oracle pass@k equals "
            "random-of-k)"
        )
    share = f"{delta / headroom:.0%} of the {headroom:.1%} gap between random-of-k and the oracle"
    if delta <= 1e-12:
        return (
            f"reranking did not help: value-reranked {rate['value-reranked']:.1%} against "
            f"random-of-k {rate['random-of-k']:.1%} ({share})"
        )
    return (
        f"reranking helped by {delta:+.1%} over random-of-k ({share}), on {n} task(s): "
        "compare the intervals before trusting a gap this size"
    )


# -- the stage -----------------------------------------------------------------------------------


def _reranked_model(ctx: StageContext) -> tuple[str, str, str]:
    """(name, weight version, line of weights) of the model to rerank."""
    models = models_to_evaluate(ctx)
    wanted = ctx.recipe.stages.rerank.model
    if wanted is None:
        main = [m for m in models if not m[2]]
        return main[-1]
    for model in models:
        if model[0] == wanted:
            return model
    raise ValueError(
        f"stages.rerank.model {wanted!r} is not a model this run evaluated; it evaluated "
        f"{', '.join(m[0] for m in models)}"
    )


def _attempts(
    ctx: StageContext, name: str, version: str, lineage: str, out: Path
) -> tuple[list[trajectory_pb2.TrajectoryGroup], str]:
    """The reranked model's held-out groups with at least k attempts each, and where they came
    from: the evaluate stage's own, or a rollout job of the evaluate stage's kind run here
    (kept in ``out``, so a resumed stage does not sample them again)."""
    k = ctx.recipe.stages.rerank.k
    evaluated = ((ctx.run.done("evaluate") or {}).get("models") or {}).get(name, {})
    sampled = evaluated.get("same_weights_as", name)
    own = ctx.run.root / "evaluate" / f"{sampled}.groups.jsonl"
    if ctx.recipe.stages.evaluate.attempts_per_task >= k and own.is_file():
        return _read_groups(own), "evaluate"
    marker = out / f"{name}.json"
    if not marker.exists():
        result = asyncio.run(_evaluate_model(ctx.line(lineage), name, version, out, attempts=k))
        write_json(marker, result)
    return _read_groups(out / f"{name}.groups.jsonl"), "rerank"


def _pairs(
    groups: Sequence[trajectory_pb2.TrajectoryGroup],
) -> dict[str, list[trajectory_pb2.Trajectory]]:
    """(task, harness) -> its scored attempts, in the order of their rollout ids (fixed, and
    unrelated to outcome or finishing time)."""
    pairs: dict[str, list[trajectory_pb2.Trajectory]] = {}
    for group in groups:
        attempts = pairs.setdefault(f"{group.task_id} {group.harness}", [])
        attempts += [t for t in main_line(group) if _scored(t)]
    return {key: sorted(a, key=lambda t: (t.rollout_id, t.id)) for key, a in pairs.items()}


def _counts(rows: Sequence[HistoryRow], mark: float) -> dict[str, Any]:
    by_source: dict[str, dict[str, int]] = {}
    for row in rows:
        entry = by_source.setdefault(row.source, {"trajectories": 0, "successes": 0})
        entry["trajectories"] += 1
        entry["successes"] += int(row.trajectory.reward.value >= mark)
    successes = sum(e["successes"] for e in by_source.values())
    return {
        "trajectories": len(rows),
        "successes": successes,
        "failures": len(rows) - successes,
        "sources": by_source,
    }


def _train(ctx: StageContext, rows: Sequence[HistoryRow], out: Path) -> tuple[Any, dict[str, Any]]:
    """The value model fitted on all of ``rows`` (None when it cannot be) and its figures: the
    validation on whole held-out tasks of the history first."""
    settings = ctx.recipe.stages.rerank
    mark = ctx.pass_mark
    space = FeatureSpace(ngrams=settings.ngrams, buckets=settings.buckets)
    trajectories = [r.trajectory for r in rows]
    labels = [t.reward.value >= mark for t in trajectories]
    successes = sum(labels)
    info: dict[str, Any] = {"ngrams": space.ngrams, "buckets": space.buckets, "l2": settings.l2}
    if not successes or successes == len(labels):
        info["trained"] = False
        info["reason"] = (
            f"the history holds {successes} success(es) and {len(labels) - successes} "
            "failure(s); a value model needs both"
        )
        return None, info
    started = time.monotonic()
    held = split_by_task(
        [t.task_id for t in trajectories],
        settings.validation_fraction,
        derived_seed(ctx.seed, "rerank", "split"),
    )
    train = [i for i, t in enumerate(trajectories) if t.task_id not in held]
    check = [i for i, t in enumerate(trajectories) if t.task_id in held]
    validation: dict[str, Any] = {"tasks": len(held), "trajectories": len(check)}
    train_labels = [labels[i] for i in train]
    if not check:
        validation["note"] = "the history has one task: nothing to hold out"
    elif all(train_labels) or not any(train_labels):
        validation["note"] = "the training part of the split has one class: not measured"
    else:
        model = fit_value_model(
            [trajectories[i] for i in train], train_labels, space=space, l2=settings.l2
        )
        scores = model.scores([trajectories[i] for i in check])
        truth = [labels[i] for i in check]
        validation["auc"] = auc(scores, truth)
        validation["accuracy"] = sum((s >= 0.5) == y for s, y in zip(scores, truth, strict=True))
        validation["accuracy"] /= len(check)
        validation["successes"] = sum(truth)
        validation["train_auc"] = auc(model.scores([trajectories[i] for i in train]), train_labels)
        if validation["auc"] is None:
            validation["note"] = "the held-out tasks have one class: no AUC"
    model = fit_value_model(trajectories, labels, space=space, l2=settings.l2)
    model.save(out / "value_model.npz")
    info.update(trained=True, validation=validation, seconds=round(time.monotonic() - started, 2))
    return model, info


def run_rerank(ctx: StageContext) -> dict[str, Any]:
    out = ctx.run.stage("rerank")
    settings = ctx.recipe.stages.rerank
    name, version, lineage = _reranked_model(ctx)
    runs = [("this run", ctx.run.root)] if settings.sources else []
    runs += [(str(p), Path(p)) for p in settings.history]
    rows = read_history(runs, settings.sources, exclude_versions={version}, skip_models={name})
    history = _counts(rows, ctx.pass_mark)
    held_out = {t.id for t in ctx.tasks["evaluate"]}
    history["on_held_out_tasks"] = sum(r.trajectory.task_id in held_out for r in rows)
    history["runs"] = [label for label, _ in runs]
    model, info = _train(ctx, rows, out)

    groups, origin = _attempts(ctx, name, version, lineage, out)
    pairs = _pairs(groups)
    scores: dict[str, list[float | None]] = {}
    for key, attempts in pairs.items():
        scores[key] = list(model.scores(attempts)) if model else [None] * len(attempts)
    marked = {
        key: [
            (t.reward.value >= ctx.pass_mark, s) for t, s in zip(attempts, scores[key], strict=True)
        ]
        for key, attempts in pairs.items()
    }
    summary: dict[str, Any] = {
        "model": name,
        "weight_version": version,
        "attempts_from": origin,
        "temperature": ctx.recipe.stages.evaluate.temperature,
        "history": history,
        "value_model": info,
        **best_of_k(marked, settings.k),
    }
    used = [a[: settings.k] for a in marked.values() if len(a) >= settings.k]
    flat = [(s, y) for attempts in used for y, s in attempts if s is not None]
    within, compared = within_task_accuracy(
        [[(float(s), y) for y, s in a if s is not None] for a in used]
    )
    summary["evaluation"] = {
        "attempts": sum(len(a) for a in used),
        "successes": sum(y for a in used for y, _ in a),
        "auc": auc([s for s, _ in flat], [y for _, y in flat]) if model else None,
        "within_task_accuracy": within,
        "within_task_pairs": compared,
    }
    summary["verdict"] = verdict(summary)
    if summary["temperature"] == 0 and settings.k > 1:
        summary["note"] = (
            "stages.evaluate.temperature is 0: the k attempts are greedy, so they differ only "
            "where the environment does, and best-of-k has little to choose from"
        )
    with (out / "scores.jsonl").open("w", encoding="utf-8") as handle:
        for key, attempts in pairs.items():
            for trajectory, score in zip(attempts, scores[key], strict=True):
                entry = {
                    "pair": key,
                    "trajectory": trajectory.id,
                    "reward": trajectory.reward.value,
                    "score": score,
                }
                handle.write(json.dumps(entry, sort_keys=True) + "\n")
    return summary


def _history_words(history: Mapping[str, Any]) -> str:
    sources = ", ".join(
        f"{name} {entry['trajectories']} ({entry['successes']} succeeded)"
        for name, entry in sorted(history.get("sources", {}).items())
    )
    text = (
        f"{history['trajectories']} scored trajectories of earlier policies, "
        f"{history['successes']} successes and {history['failures']} failures"
    )
    if sources:
        text += f": {sources}"
    if history.get("on_held_out_tasks"):
        text += f"; {history['on_held_out_tasks']} of them on the held-out tasks"
    return text


def _model_words(info: Mapping[str, Any]) -> str:
    if not info.get("trained"):
        return f"none: {info.get('reason', 'not trained')}"
    validation = info.get("validation", {})
    shape = (
        f"logistic regression on hashed word 1- to {info['ngrams']}-grams "
        f"({info['buckets']} buckets, L2 {info['l2']:g}), fitted in {info.get('seconds', 0):g} s"
    )
    if "auc" not in validation:
        return f"{shape}; {validation.get('note', 'not validated')}"
    measured = (
        f"on {validation['tasks']} held-out task(s) of the history "
        f"({validation['trajectories']} trajectories, {validation['successes']} of them "
        "successes): "
    )
    auc_text = "-" if validation["auc"] is None else f"{validation['auc']:.3f}"
    train_auc = validation.get("train_auc")
    measured += f"AUC {auc_text}, accuracy {validation['accuracy']:.1%}"
    if train_auc is not None:
        measured += f" (training AUC {train_auc:.3f})"
    return f"{shape}; {measured}; then refitted on the whole history"


def rerank_report(done: Mapping[str, Any] | None) -> Reranking | None:
    """The report's section from the stage's ``done.json``; None when it did not run."""
    if not done:
        return None
    figures = tuple(
        RerankFigure(name, float(f["successes"]), int(f["tasks"]))
        for name in FIGURES
        if (f := done["figures"].get(name)) is not None
    )
    evaluation = done.get("evaluation", {})
    notes = []
    if done.get("attempts_from") == "evaluate":
        notes.append("the attempts are the evaluate stage's own (it made at least k per task)")
    if done.get("note"):
        notes.append(done["note"])
    return Reranking(
        model=done["model"],
        k=int(done["k"]),
        figures=figures,
        tasks_short=int(done.get("tasks_short", 0)),
        history=_history_words(done["history"]),
        value_model=_model_words(done["value_model"]),
        evaluation_auc=evaluation.get("auc"),
        within_task_accuracy=evaluation.get("within_task_accuracy"),
        verdict=done.get("verdict", ""),
        notes=tuple(notes),
    )
