"""The report of a run evaluated on several harnesses: the evaluate stage's per-harness counts
become per-harness rows with pass@k and pass^k, k being the recipe's attempts per task."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchard.recipes.pipeline import build_report
from orchard.recipes.stages import StageContext
from orchard.recipes.workspace import RunDir, StackEndpoints
from orchard.sdk.recipe import Recipe
from orchard.sdk.report import write_report


def _context(tmp_path: Path) -> StageContext:
    recipe = Recipe.model_validate(
        {
            "name": "claw-small",
            "tasks": {"builtin": {"count": 24}},
            # Not in alphabetical order: the report keeps the recipe's order.
            "harnesses": ["program:codex", "program:claude-code"],
            "stages": {
                "credit": {"enabled": False},
                "evaluate": {"attempts_per_task": 3, "harnesses": ["program:openclaw"]},
            },
        }
    )
    stack = StackEndpoints(env="e", env_token="", reward="r", etcd="x", trainer="t", rollout="o")
    return StageContext(recipe=recipe, run=RunDir(tmp_path / "run"), stack=stack, tasks={})


def _harness(held_out: bool, tasks: dict[str, list[int]], excluded: int = 0) -> dict[str, Any]:
    return {
        "held_out": held_out,
        "resolved": sum(c for _, c in tasks.values()),
        "attempts": sum(n for n, _ in tasks.values()),
        "excluded": excluded,
        "tasks": tasks,
    }


def _model(name: str, version: str, by_harness: dict[str, Any] | None) -> dict[str, Any]:
    rows = list((by_harness or {}).values())
    result: dict[str, Any] = {
        "model": name,
        "weight_version": version,
        "rollout_job": f"job-{name}",
        "resolved": sum(r["resolved"] for r in rows),
        "attempts": sum(r["attempts"] for r in rows),
        "excluded": sum(r["excluded"] for r in rows),
        "by_family": {},
    }
    if by_harness is not None:
        result["by_harness"] = by_harness
    return result


def test_build_report_reads_each_models_harnesses(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    base = {
        "program:openclaw": _harness(True, {"claw/a/1": [3, 0], "claw/b/2": [3, 0]}),
        "program:codex": _harness(False, {"claw/a/1": [3, 1], "claw/b/2": [2, 2]}, excluded=1),
        "program:claude-code": _harness(False, {"claw/a/1": [3, 2], "claw/b/2": [3, 0]}),
    }
    rl = {
        "program:openclaw": _harness(True, {"claw/a/1": [3, 3], "claw/b/2": [3, 1]}),
        "program:codex": _harness(False, {"claw/a/1": [3, 3], "claw/b/2": [3, 2]}),
        "program:claude-code": _harness(False, {"claw/a/1": [3, 3], "claw/b/2": [3, 3]}),
    }
    sft = {**_model("rl", "v5", rl), "model": "sft", "same_weights_as": "rl"}
    ctx.run.finish(
        "evaluate",
        {
            "models": {
                "base": _model("base", "base", base),
                "rl": _model("rl", "v5", rl),
                "sft": sft,
            }
        },
    )

    report = build_report(ctx)

    assert [e.model for e in report.evaluations] == ["base", "sft", "rl"]
    first = report.evaluations[0]
    assert [h.harness for h in first.harnesses] == [
        "program:codex",
        "program:claude-code",
        "program:openclaw",
    ]
    assert [h.held_out for h in first.harnesses] == [False, False, True]
    codex = first.harnesses[0]
    assert (codex.resolved, codex.attempts, codex.excluded, codex.k) == (3, 5, 1, 3)
    assert codex.tasks == {"claw/a/1": (3, 1), "claw/b/2": (2, 2)}
    estimate = codex.pass_k
    # claw/b/2 had an attempt excluded: 2 scored, short of k = 3, left out.
    assert (estimate.tasks_used, estimate.tasks_short) == (1, 1)
    assert (estimate.pass_at_k, estimate.pass_hat_k) == (1.0, 0.0)
    claude = first.harnesses[1].pass_k
    assert claude.pass_at_k == pytest.approx((1.0 + 0.0) / 2)
    assert claude.pass_hat_k == 0.0
    assert report.evaluations[1].harnesses == report.evaluations[2].harnesses
    assert report.evaluations[1].weight_version == "v5 (the rl model's)"

    markdown = write_report(report, ctx.run.root / "report").read_text()
    assert "| pass@3 | pass^3 |" in markdown
    assert (
        "| rl | program:openclaw (held out) | 4 | 6 | 0 | 66.7% | 30.0% to 90.3% | 100.0% "
        "| 50.0% | 2 |" in markdown
    )
    assert "| base | program:codex | 3 | 5 | 1 | 60.0% | " in markdown
    data = json.loads((ctx.run.root / "report" / "report.json").read_text())
    rows = data["evaluations"][2]["harnesses"]
    assert [r["harness"] for r in rows] == [
        "program:codex",
        "program:claude-code",
        "program:openclaw",
    ]
    assert rows[1]["pass_hat_k"] == 1.0 and rows[2]["pass_hat_k"] == pytest.approx(0.5)


def test_a_run_from_before_per_harness_counts_has_no_harness_rows(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    ctx.run.finish("evaluate", {"models": {"base": _model("base", "base", None)}})
    report = build_report(ctx)
    assert [(e.model, e.harnesses) for e in report.evaluations] == [("base", ())]
    markdown = write_report(report, ctx.run.root / "report").read_text()
    assert "By harness" not in markdown
    assert json.loads((ctx.run.root / "report" / "families.json").read_text()) == {"base": {}}
