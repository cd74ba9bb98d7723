"""The service's own Prometheus metrics, in the server's registry (``orchard_trainer_*``)."""

from __future__ import annotations

from orchard.core.metrics import ServiceMetrics
from orchard.trainer.telemetry import StepRecorder

__all__ = ["TrainerMetrics"]

_SAVE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class TrainerMetrics:
    """Jobs by state, submitted groups and trajectories, checkpoints and publications, and the
    per-step gauges of `telemetry.StepRecorder` (loss, learning rate, grad norm, tokens/s,
    entropy, clip fraction, importance weights, KL, reward mean; labels ``job`` and ``mode``).

    Without a metrics address the server has no registry; these then go to a private one that
    nobody scrapes, so the code that records them needs no conditions.
    """

    def __init__(self, metrics: ServiceMetrics | None) -> None:
        m = metrics if metrics is not None else ServiceMetrics("trainer")
        self.registry = m.registry
        self.steps = StepRecorder(None, metrics=m)
        self.jobs = m.counter(
            "jobs_total",
            "Jobs that reached each state (pending, running, succeeded, failed, cancelled), "
            "by mode (sft, rl).",
            ["mode", "state"],
        )
        self.running_jobs = m.gauge("running_jobs", "Jobs with an engine in this process now.")
        self.groups = m.counter(
            "groups_submitted_total", "Trajectory groups accepted by SubmitGroups.", ["mode"]
        )
        self.trajectories = m.counter(
            "trajectories_submitted_total",
            "Submitted trajectories, by mode and whether they entered the buffer "
            "(trainable) or were kept out of the loss (skipped).",
            ["mode", "outcome"],
        )
        self.checkpoints = m.counter("checkpoints_total", "Checkpoints saved.", ["mode"])
        self.checkpoint_seconds = m.histogram(
            "checkpoint_seconds",
            "Time to save one checkpoint (DeepSpeed and Hugging Face format).",
            buckets=_SAVE_BUCKETS,
        )
        self.publications = m.counter(
            "publications_total", "Weight versions published to the registry.", ["mode"]
        )
