"""The service's own Prometheus metrics, in the server's registry (``orchard_reward_*``)."""

from __future__ import annotations

from orchard.core.metrics import ServiceMetrics
from orchard.reward.outcome import ScoreResult

__all__ = ["RewardMetrics"]

# Judges answer in seconds; test runs take up to the time limit (minutes).
_SCORER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RewardMetrics:
    """``orchard_reward_*``: rewards by scorer and status, scorer latency, judge retries and
    exclusions by reason.

    Without a metrics address the server has no registry; these then go to a private one that
    nobody scrapes, so the code that records them needs no conditions.
    """

    def __init__(self, metrics: ServiceMetrics | None) -> None:
        m = metrics if metrics is not None else ServiceMetrics("reward")
        self.registry = m.registry
        self.rewards = m.counter(
            "rewards_total",
            "Rewards given, by scorer (tests, judge, gui_state_judge, rubric, task_score, "
            "credit) and status (scored, excluded).",
            ["scorer", "status"],
        )
        self.scorer_seconds = m.histogram(
            "scorer_seconds",
            "Time to score one request, by scorer: sandbox work or judge calls included.",
            ["scorer"],
            buckets=_SCORER_BUCKETS,
        )
        self.exclusions = m.counter(
            "exclusions_total",
            "Rewards excluded (never trained on), by scorer and reason "
            "(sandbox_failure, timeout, judge_unavailable, ...).",
            ["scorer", "reason"],
        )
        self.judge_retries = m.counter(
            "judge_retries_total",
            "Judge calls tried again after a failed attempt, by judge and failure kind "
            "(timeout, http_error, connection, bad_response, malformed).",
            ["judge", "reason"],
        )

    def record(self, result: ScoreResult, seconds: float) -> None:
        """Count one finished scoring and its latency."""
        status = "scored" if result.is_scored else "excluded"
        self.rewards.labels(result.scorer, status).inc()
        self.scorer_seconds.labels(result.scorer).observe(seconds)
        if result.exclusion is not None:
            self.exclusions.labels(result.scorer, result.exclusion.value).inc()

    def judge_retry(self, judge: str, reason: str) -> None:
        self.judge_retries.labels(judge, reason).inc()
