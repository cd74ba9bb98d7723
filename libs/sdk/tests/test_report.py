"""The run report: intervals, metric parsing from the env service's own metrics, and files a
person can open."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from orchard.sdk.report import (
    Curve,
    GroupStats,
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

    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [e["model"] for e in data["evaluations"]] == ["base", "sft", "rl"]
    assert data["evaluations"][1]["interval"] == pytest.approx([0.2538, 0.7462], abs=5e-4)
    assert data["trajectories"]["excluded"] == {"sandbox failure": 2}


def test_wilson_bounds_are_exact_at_none_and_all() -> None:
    assert wilson_interval(0, 5)[0] == 0.0
    assert wilson_interval(5, 5)[1] == 1.0
    assert 0.0 < wilson_interval(1, 5)[0] < 0.2
