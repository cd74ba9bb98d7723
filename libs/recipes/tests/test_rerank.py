"""The rerank stage without services: best-of-k and the four figures, the history it reads
(never the reranked model's own rollouts), a run folder whose evaluate stage already made k
attempts (reused, nothing sampled), a history of one class, and the report's section."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from orchard.recipes.pipeline import build_report
from orchard.recipes.rerank import (
    HistoryError,
    best_of_k,
    read_history,
    rerank_report,
    run_rerank,
    verdict,
)
from orchard.recipes.stages import StageContext
from orchard.recipes.workspace import RunDir, StackEndpoints, write_json
from orchard.sdk.recipe import Recipe
from orchard.sdk.report import write_report
from orchard.types.v1 import reward_pb2, trajectory_pb2

from .test_value_model import trajectory


def _figures(summary: dict[str, Any]) -> dict[str, float | None]:
    n = summary["tasks"]
    return {
        name: None if f is None else f["successes"] / n for name, f in summary["figures"].items()
    }


def test_best_of_k_picks_the_top_score_and_sets_the_four_figures_side_by_side() -> None:
    pairs = {
        # the value model picks the success
        "a": [(False, 0.2), (True, 0.9), (False, 0.1)],
        # it picks a failure although a success was there
        "b": [(True, 0.3), (False, 0.8), (False, 0.1)],
        # all fail
        "c": [(False, 0.5), (False, 0.4), (False, 0.6)],
        # all succeed
        "d": [(True, 0.5), (True, 0.4), (True, 0.6)],
    }
    summary = best_of_k(pairs, 3)
    assert (summary["tasks"], summary["tasks_short"]) == (4, 0)
    assert _figures(summary) == {
        "pass@1": pytest.approx(2 / 4),  # a's first failed, b's and d's first succeeded
        "random-of-k": pytest.approx((1 / 3 + 1 / 3 + 0 + 1) / 4),
        "value-reranked": pytest.approx(2 / 4),
        "oracle pass@k": pytest.approx(3 / 4),
    }


def test_tied_top_scores_count_their_mean_success() -> None:
    summary = best_of_k({"a": [(True, 0.7), (False, 0.7), (False, 0.1)]}, 3)
    assert summary["figures"]["value-reranked"]["successes"] == pytest.approx(0.5)


def test_at_k_1_all_four_figures_are_the_same() -> None:
    pairs = {"a": [(True, 0.1)], "b": [(False, 0.9)], "c": [(True, 0.5)]}
    figures = _figures(best_of_k(pairs, 1))
    assert list(figures.values()) == [pytest.approx(2 / 3)] * 4


def test_all_failed_gives_zero_everywhere_and_says_reranking_could_not_help() -> None:
    summary = best_of_k({"a": [(False, 0.3), (False, 0.6)], "b": [(False, 0.2), (False, 0.1)]}, 2)
    assert set(_figures(summary).values()) == {0.0}
    summary["value_model"] = {"trained": True}
    assert verdict(summary).startswith("reranking could not help")


def test_short_pairs_are_left_out_and_only_the_first_k_attempts_count() -> None:
    pairs = {"a": [(False, 0.1), (True, 0.9), (True, 0.9)], "b": [(True, 0.5)]}
    summary = best_of_k(pairs, 2)
    assert (summary["tasks"], summary["tasks_short"]) == (1, 1)
    assert summary["figures"]["random-of-k"]["successes"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="k must be at least 1"):
        best_of_k(pairs, 0)


def test_without_scores_there_is_no_reranked_figure_and_the_verdict_says_why() -> None:
    summary = best_of_k({"a": [(True, None), (False, None)]}, 2)
    assert summary["figures"]["value-reranked"] is None
    summary["value_model"] = {"trained": False, "reason": "the history holds 0 success(es)"}
    assert verdict(summary) == ("no value model, so no reranking: the history holds 0 success(es)")


def test_the_verdict_says_when_reranking_did_not_help() -> None:
    summary = best_of_k({"a": [(True, 0.1), (False, 0.9)], "b": [(True, 0.9), (False, 0.1)]}, 2)
    summary["value_model"] = {"trained": True}
    assert _figures(summary)["value-reranked"] == _figures(summary)["random-of-k"] == 0.5
    assert verdict(summary).startswith("reranking did not help: value-reranked 50.0%")
    summary = best_of_k({"a": [(True, 0.9), (False, 0.1)]}, 2)
    summary["value_model"] = {"trained": True}
    assert verdict(summary).startswith("reranking helped by +50.0% over random-of-k (100% of")


# -- the history ---------------------------------------------------------------------------------


def _group(task: str, rows: Sequence[trajectory_pb2.Trajectory], harness: str = "builtin:swe") -> (
    trajectory_pb2.TrajectoryGroup
):  # fmt: skip
    group = trajectory_pb2.TrajectoryGroup(task_id=task, harness=harness)
    for i, row in enumerate(rows):
        member = group.trajectories.add()
        member.CopyFrom(row)
        member.task_id = task
        member.rollout_id = member.rollout_id or f"{task}-r{i}-{member.id}"
    return group


def _write(path: Path, groups: Sequence[trajectory_pb2.TrajectoryGroup]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json_format.MessageToJson(g, indent=None) + "\n" for g in groups))


def _sampled_by(row: trajectory_pb2.Trajectory, version: str) -> trajectory_pb2.Trajectory:
    for turn in row.turns:
        turn.weight_version = version
    return row


def test_the_history_leaves_out_the_reranked_weights_unscored_rollouts_and_other_sources(
    tmp_path: Path,
) -> None:
    rng = random.Random(1)
    teacher = [_sampled_by(trajectory("s1", w, rng), "teacher") for w in (True, False)]
    unscored = trajectory("s1", False, rng)
    unscored.reward.status = reward_pb2.REWARD_STATUS_EXCLUDED
    _write(tmp_path / "collect" / "groups.jsonl", [_group("s1", [*teacher, unscored])])
    earlier = _sampled_by(trajectory("r1", True, rng), "step-1")
    own = _sampled_by(trajectory("r1", False, rng), "step-2")  # the reranked weights
    _write(tmp_path / "rl" / "groups.jsonl", [_group("r1", [earlier, own])])
    _write(tmp_path / "rl" / "from-base" / "groups.jsonl", [_group("r2", [earlier])])  # same id
    base = _sampled_by(trajectory("e1", False, rng), "base")
    _write(tmp_path / "evaluate" / "base.groups.jsonl", [_group("e1", [base])])
    _write(tmp_path / "evaluate" / "rl.groups.jsonl", [_group("e1", [own])])

    rows = read_history([("this run", tmp_path)], ["collect", "rl"], exclude_versions={"step-2"})
    assert [r.trajectory.id for r in rows] == [teacher[0].id, teacher[1].id, earlier.id]
    assert [r.source for r in rows] == ["this run: collect"] * 2 + ["this run: rl"]
    with_evaluate = read_history(
        [("this run", tmp_path)],
        ["evaluate"],
        exclude_versions={"step-2"},
        skip_models={"rl"},
    )
    assert [r.trajectory.id for r in with_evaluate] == [base.id]


def test_a_missing_or_empty_history_run_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match=r"history run runs/gone: .* is not a folder"):
        read_history([("runs/gone", tmp_path / "gone")], ["collect"], exclude_versions=set())
    (tmp_path / "empty").mkdir()
    with pytest.raises(HistoryError, match="holds none of the rollouts of collect, rl"):
        read_history(
            [("runs/empty", tmp_path / "empty")], ["collect", "rl"], exclude_versions=set()
        )
    (tmp_path / "bad" / "collect").mkdir(parents=True)
    (tmp_path / "bad" / "collect" / "groups.jsonl").write_text('{"taskId": 3, "x": 1}\n')
    with pytest.raises(HistoryError, match=r"groups.jsonl, line 1: not a trajectory group"):
        read_history([("runs/bad", tmp_path / "bad")], ["collect"], exclude_versions=set())


# -- the stage on a run folder -------------------------------------------------------------------

K = 3


def _run_folder(tmp_path: Path, *, history_wins: Sequence[bool], seed: int = 4) -> StageContext:
    """A run folder as collect, sft, rl and evaluate leave it, the evaluate stage with K
    attempts per held-out task of the RL model ("step-2"): the stage needs no service."""
    recipe = Recipe.model_validate(
        {
            "name": "unit",
            "tasks": {"builtin": {"count": 12, "seed": 1}},
            "output_dir": str(tmp_path / "run"),
            "stages": {
                "evaluate": {"attempts_per_task": K, "temperature": 1.0},
                "rerank": {"enabled": True, "k": K},
            },
        }
    )
    run = RunDir.open(recipe)
    rng = random.Random(seed)
    collect = [
        _group(f"sft-{i}", [_sampled_by(trajectory(f"sft-{i}", w, rng, tell=0.95), "teacher")])
        for i, w in enumerate(history_wins)
    ]
    _write(run.root / "collect" / "groups.jsonl", collect)
    write_json(run.root / "sft" / "done.json", {"weights": {"version": "step-1"}})
    write_json(run.root / "rl" / "done.json", {"weights": {"version": "step-2"}})
    held = [f"held-{i}" for i in range(8)]
    groups = []
    for task in held:
        attempts = [trajectory(task, rng.random() < 0.4, rng, tell=0.95) for _ in range(K)]
        groups.append(_group(task, [_sampled_by(a, "step-2") for a in attempts]))
    _write(run.root / "evaluate" / "rl.groups.jsonl", groups)
    resolved = sum(t.reward.value > 0 for g in groups for t in g.trajectories)
    evaluated = {"resolved": resolved, "attempts": len(held) * K, "weight_version": "step-2"}
    write_json(run.root / "evaluate" / "done.json", {"models": {"rl": evaluated}})
    stack = StackEndpoints("127.0.0.1:1", "", "127.0.0.1:2", "", "127.0.0.1:3", "127.0.0.1:4")
    tasks: dict[str, Any] = {"evaluate": [_Task(t) for t in held]}
    return StageContext(recipe=recipe, run=run, stack=stack, tasks=tasks, seed=seed)


class _Task:
    def __init__(self, task_id: str) -> None:
        self.id = task_id


def test_the_stage_reranks_the_evaluate_stages_own_attempts_with_a_model_of_the_history(
    tmp_path: Path,
) -> None:
    rng = random.Random(9)
    ctx = _run_folder(tmp_path, history_wins=[rng.random() < 0.4 for _ in range(120)])
    summary = run_rerank(ctx)
    assert (summary["model"], summary["weight_version"]) == ("rl", "step-2")
    assert summary["attempts_from"] == "evaluate"  # nothing sampled: no service was called
    assert summary["history"]["trajectories"] == 120
    assert summary["history"]["on_held_out_tasks"] == 0
    model = summary["value_model"]
    assert model["trained"] and model["validation"]["auc"] > 0.8, model
    figures = _figures(summary)
    assert summary["tasks"] == 8
    # the signal carries over to the new policy's attempts: the pick beats a random one
    assert figures["value-reranked"] > figures["random-of-k"]
    assert figures["value-reranked"] <= figures["oracle pass@k"]
    assert summary["evaluation"]["auc"] > 0.8
    assert summary["verdict"].startswith("reranking helped")
    scores = (ctx.run.root / "rerank" / "scores.jsonl").read_text().splitlines()
    assert len(scores) == 8 * K and (ctx.run.root / "rerank" / "value_model.npz").is_file()
    # the same run folder and seed give the same numbers
    again = run_rerank(ctx)
    assert (
        again["figures"] == summary["figures"]
        and again["value_model"]["validation"] == (model["validation"])
    )


@pytest.mark.parametrize("won", [True, False])
def test_a_history_of_one_class_trains_no_model_and_the_report_says_so(
    tmp_path: Path, won: bool
) -> None:
    ctx = _run_folder(tmp_path, history_wins=[won] * 10)
    summary = run_rerank(ctx)
    assert summary["value_model"]["trained"] is False
    assert summary["figures"]["value-reranked"] is None
    assert summary["evaluation"]["auc"] is None
    assert "a value model needs both" in summary["verdict"]
    ctx.run.finish("rerank", summary)
    section = rerank_report(ctx.run.done("rerank"))
    assert section is not None
    assert [f.name for f in section.figures] == ["pass@1", "random-of-k", "oracle pass@k"]
    text = write_report(build_report(ctx), ctx.run.root / "report").read_text()
    assert "## Best-of-3 by a value model (rl)" in text
    assert "value model: none: the history holds" in text


def test_the_report_section_explains_the_four_numbers(tmp_path: Path) -> None:
    rng = random.Random(9)
    ctx = _run_folder(tmp_path, history_wins=[rng.random() < 0.4 for _ in range(60)])
    ctx.run.finish("rerank", run_rerank(ctx))
    markdown = write_report(build_report(ctx), ctx.run.root / "report")
    text = markdown.read_text()
    for words in (
        "| pass@1 | one attempt per task",
        "| random-of-k | one of the k attempts picked at random",
        "| value-reranked | the attempt the value model scores highest",
        "| oracle pass@k | any of the k attempts succeeded",
        "history: 60 scored trajectories of earlier policies",
        "held-out task(s) of the history",
    ):
        assert words in text, words
    data = json.loads((markdown.parent / "report.json").read_text())
    figures = data["rerank"]["figures"]
    assert [f["name"] for f in figures] == ["pass@1", "random-of-k", "value-reranked",
                                             "oracle pass@k"]  # fmt: skip
    for figure in figures:
        low, high = figure["interval"]
        assert 0 <= low <= figure["rate"] <= high <= 1 and figure["tasks"] == 8


def test_a_rerank_model_the_run_did_not_evaluate_is_named(tmp_path: Path) -> None:
    ctx = _run_folder(tmp_path, history_wins=[True, False])
    settings = ctx.recipe.stages.rerank.model_copy(update={"model": "rl-base"})
    stages = ctx.recipe.stages.model_copy(update={"rerank": settings})
    ctx.recipe = ctx.recipe.model_copy(update={"stages": stages})
    with pytest.raises(ValueError, match=r"'rl-base' is not a model this run evaluated; .*rl"):
        run_rerank(ctx)
