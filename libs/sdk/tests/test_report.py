"""The run report: intervals, metric parsing from the env service's own metrics, and files a
person can open."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from orchard.sdk import report as report_module
from orchard.sdk.report import (
    Curve,
    GroupStats,
    HarnessEvaluation,
    ModelEvaluation,
    RunReport,
    TrajectoryCounts,
    histogram_quantile,
    service_stats_from_metrics,
    wilson_interval,
    write_report,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("successes", "trials", "expected"),
    [
        # Reference values of the Wilson score interval at 95 %.
        (8, 10, (0.4902, 0.9433)),
        (0, 10, (0.0, 0.2775)),
        (10, 10, (0.7225, 1.0)),
        (50, 100, (0.4038, 0.5962)),
    ],
)
def test_wilson_interval_matches_reference_values(
    successes: int, trials: int, expected: tuple[float, float]
) -> None:
    low, high = wilson_interval(successes, trials)
    assert low == pytest.approx(expected[0], abs=5e-4)
    assert high == pytest.approx(expected[1], abs=5e-4)


def test_wilson_interval_edges() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)
    narrow, wide = wilson_interval(5, 10, 0.8), wilson_interval(5, 10, 0.99)
    assert wide[0] < narrow[0] < 0.5 < narrow[1] < wide[1]
    with pytest.raises(ValueError, match="successes <= trials"):
        wilson_interval(11, 10)


def test_histogram_quantile_interpolates_inside_a_bucket() -> None:
    buckets = [(0.01, 10.0), (0.1, 90.0), (1.0, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01 + 0.09 * (40 / 80))
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.005)
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.1 + 0.9 * 0.5)
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.99, [(0.1, 1.0), (math.inf, 10.0)]) == 0.1


def test_service_stats_read_the_env_services_own_metrics() -> None:
    from orchard.env.metrics import EnvMetrics

    metrics = EnvMetrics(None)
    for seconds in (0.002, 0.003, 0.004, 0.2):
        metrics.exec_seconds.labels(code="OK").observe(seconds)
    metrics.exec_seconds.labels(code="DEADLINE_EXCEEDED").observe(0.004)
    for _ in range(3):
        metrics.create_seconds.observe(0.01)
    metrics.failed.labels(reason="OUT_OF_MEMORY").inc()
    metrics.reaped.inc(2)
    text = generate_latest(metrics.registry_owner.registry).decode()

    stats = service_stats_from_metrics(text)
    assert stats.sandboxes_created == 3
    assert stats.sandboxes_failed == {"OUT_OF_MEMORY": 1}
    assert stats.sandboxes_reaped == 2
    assert stats.execs == 5
    assert stats.exec_p50_s is not None and stats.exec_p95_s is not None
    assert 0.001 < stats.exec_p50_s < 0.01 < stats.exec_p95_s <= 0.5


def test_report_files_hold_the_numbers(tmp_path: Path) -> None:
    report = RunReport(
        title="Run builtin-swe",
        evaluations=(
            ModelEvaluation("base", 1, 12),
            ModelEvaluation("sft", 6, 12, "v3"),
            ModelEvaluation("rl", 7, 12, "v7"),
        ),
        curves=(Curve("sft loss", (1, 2, 3), (2.5, 1.25, 0.5)), Curve("rl reward", (), ())),
        groups=(GroupStats("bar", 4, 40, 3, 0.5, {"balanced": 3, "top_ranked": 1}),),
        trajectories=TrajectoryCounts(
            resolved=9, unresolved=15, credit_assigned=6, excluded={"sandbox failure": 2}
        ),
        stage_seconds={"collect": 12.5, "sft": 30.0},
        notes=("RL ran 4 steps",),
    )
    markdown = write_report(report, tmp_path / "out")
    text = markdown.read_text()
    assert "| sft | v3 | 6 | 12 | 50.0% | 25.4% to 74.6% |" in text
    assert "| sft loss | 3 | 2.5 | 0.5 | 0.5 |" in text
    assert "| bar | 4 | 3 | 40 | 13.3 | 0.500 | balanced 3, top_ranked 1 |" in text
    assert "| 9 | 15 | 6 | 2 |" in text and "- sandbox failure: 2" in text
    assert "| collect | 12.5 |" in text and "- RL ran 4 steps" in text

    for image in ("resolve_rate.png", "curves.png"):
        assert f"]({image})" in text
        assert (tmp_path / "out" / image).read_bytes().startswith(PNG_SIGNATURE)

    # A run that recorded no harnesses: no harness table, no harness rows in the JSON.
    assert "By harness" not in text and "pass@" not in text

    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [e["model"] for e in data["evaluations"]] == ["base", "sft", "rl"]
    assert data["evaluations"][1]["interval"] == pytest.approx([0.2538, 0.7462], abs=5e-4)
    assert [e["harnesses"] for e in data["evaluations"]] == [[], [], []]
    assert data["trajectories"]["excluded"] == {"sandbox failure": 2}


def test_wilson_bounds_are_exact_at_none_and_all() -> None:
    assert wilson_interval(0, 5)[0] == 0.0
    assert wilson_interval(5, 5)[1] == 1.0
    assert 0.0 < wilson_interval(1, 5)[0] < 0.2


def _harnesses(
    claude: dict[str, tuple[int, int]],
    codex: dict[str, tuple[int, int]],
    openclaw: dict[str, tuple[int, int]],
    excluded: int = 0,
) -> tuple[HarnessEvaluation, ...]:
    def row(name: str, tasks: dict[str, tuple[int, int]], held_out: bool) -> HarnessEvaluation:
        resolved = sum(c for _, c in tasks.values())
        attempts = sum(n for n, _ in tasks.values())
        return HarnessEvaluation(
            name,
            resolved,
            attempts,
            held_out=held_out,
            excluded=excluded if name == "program:claude-code" else 0,
            k=3,
            tasks=tasks,
        )

    return (
        row("program:claude-code", claude, False),
        row("program:codex", codex, False),
        row("program:openclaw", openclaw, True),
    )


def test_report_gives_pass_at_k_and_pass_hat_k_per_model_and_harness(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _harnesses(
        {"t1": (3, 0), "t2": (3, 1), "t3": (2, 0)},  # t3: one attempt excluded, short of k
        {"t1": (3, 1), "t2": (3, 2), "t3": (3, 0)},
        {"t1": (3, 0), "t2": (3, 0), "t3": (3, 0)},
        excluded=1,
    )
    rl = _harnesses(
        {"t1": (3, 3), "t2": (3, 2), "t3": (3, 1)},
        {"t1": (3, 3), "t2": (3, 3), "t3": (3, 0)},
        {"t1": (3, 1), "t2": (3, 1), "t3": (3, 3)},
    )
    report = RunReport(
        title="Run claw",
        evaluations=(
            ModelEvaluation("base", 4, 26, "base", base),
            ModelEvaluation("rl", 17, 27, "v4", rl),
        ),
    )
    plotted: list[list[str]] = []
    by_harness = report_module._plot_by_harness

    def spy(report: RunReport, harnesses: list[str], folder: Path, pyplot: object) -> str:
        plotted.append(list(harnesses))
        return by_harness(report, harnesses, folder, pyplot)

    monkeypatch.setattr(report_module, "_plot_by_harness", spy)
    text = write_report(report, tmp_path / "out").read_text()

    # The per-model table stays as it was, the harness table follows it.
    assert "| base | base | 4 | 26 | 15.4% | 6.2% to 33.5% |" in text
    assert "| rl | v4 | 17 | 27 | 63.0% | 44.2% to 78.5% |" in text
    assert text.index("| rl | v4 |") < text.index("### By harness")
    assert "| pass@3 | pass^3 | tasks |" in text
    rows = [
        # base, claude-code: pass@3 over t1 (0) and t2 (1); t3 has 2 attempts, left out.
        "| base | program:claude-code | 1 | 8 | 1 | 12.5% | 2.2% to 47.1% | 50.0% | 0.0% "
        "| 2 (1 short) |",
        "| base | program:codex | 3 | 9 | 0 | 33.3% | 12.1% to 64.6% | 66.7% | 0.0% | 3 |",
        "| base | program:openclaw (held out) | 0 | 9 | 0 | 0.0% | 0.0% to 29.9% | 0.0% | "
        "0.0% | 3 |",
        "| rl | program:claude-code | 6 | 9 | 0 | 66.7% | 35.4% to 87.9% | 100.0% | 33.3% | 3 |",
        "| rl | program:codex | 6 | 9 | 0 | 66.7% | 35.4% to 87.9% | 66.7% | 66.7% | 3 |",
        "| rl | program:openclaw (held out) | 5 | 9 | 0 | 55.6% | 26.7% to 81.1% | 100.0% | "
        "33.3% | 3 |",
    ]
    positions = []
    for row in rows:
        assert row in text
        positions.append(text.index(row))
    assert positions == sorted(positions)
    assert "narrower than they should be" in text

    assert plotted == [["program:claude-code", "program:codex", "program:openclaw"]]
    assert (tmp_path / "out" / "resolve_rate.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "](resolve_rate.png)" in text

    data = json.loads((tmp_path / "out" / "report.json").read_text())
    first, last = data["evaluations"]
    assert [h["harness"] for h in first["harnesses"]] == [
        "program:claude-code",
        "program:codex",
        "program:openclaw",
    ]
    claude = first["harnesses"][0]
    assert claude["tasks"] == {"t1": [3, 0], "t2": [3, 1], "t3": [2, 0]}
    assert (claude["resolved"], claude["attempts"], claude["excluded"], claude["k"]) == (1, 8, 1, 3)
    assert (claude["pass_at_k"], claude["pass_hat_k"]) == (0.5, 0.0)
    assert (claude["tasks_used"], claude["tasks_short"]) == (2, 1)
    assert claude["held_out"] is False and first["harnesses"][2]["held_out"] is True
    assert claude["interval"] == pytest.approx([0.0224, 0.4709], abs=5e-4)
    openclaw = last["harnesses"][2]
    assert openclaw["rate"] == pytest.approx(5 / 9)
    assert openclaw["pass_at_k"] == 1.0
    assert openclaw["pass_hat_k"] == pytest.approx(1 / 3)


def test_one_harness_keeps_the_models_plot_and_a_harness_never_run_shows_dashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*_: object) -> str:
        raise AssertionError("one harness: the plot of models, not of harnesses")

    monkeypatch.setattr(report_module, "_plot_by_harness", refuse)
    only = HarnessEvaluation("builtin:swe", 2, 4, k=2, tasks={"a": (2, 1), "b": (2, 1)})
    never = HarnessEvaluation("builtin:swe", 0, 0, k=2)
    report = RunReport(
        title="Run swe",
        evaluations=(
            ModelEvaluation("base", 0, 0, harnesses=(never,)),
            ModelEvaluation("sft", 2, 4, "v1", (only,)),
        ),
    )
    text = write_report(report, tmp_path / "out").read_text()
    assert "| base | builtin:swe | 0 | 0 | 0 | - | - | - | - | 0 |" in text
    assert "| sft | builtin:swe | 2 | 4 | 0 | 50.0% | 15.0% to 85.0% | 100.0% | 0.0% | 2 |" in text
    assert (tmp_path / "out" / "resolve_rate.png").read_bytes().startswith(PNG_SIGNATURE)
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["evaluations"][0]["harnesses"][0]["pass_at_k"] is None


def test_a_harness_row_needs_a_k() -> None:
    with pytest.raises(ValueError, match="k must be at least 1"):
        HarnessEvaluation("program:codex", 0, 0, k=0)
