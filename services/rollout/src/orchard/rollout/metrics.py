"""The service's own Prometheus metrics, in the server's registry (``orchard_rollout_*``)."""

from __future__ import annotations

from orchard.core.metrics import ServiceMetrics
from orchard.rollout.provenance import RolloutRecord

__all__ = ["RolloutMetrics"]

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ROLLOUT_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200)


class RolloutMetrics:
    """``orchard_rollout_*``: rollouts started, running and finished by status, groups emitted
    and dropped, the latency of agent steps (model calls and tool executions) and of whole
    rollouts, jobs running, adopted and removed by the retention, restarts of the job watch,
    engines of job policies running.

    Without a metrics address the server has no registry; these then go to a private one.
    """

    def __init__(self, metrics: ServiceMetrics | None) -> None:
        m = metrics if metrics is not None else ServiceMetrics("rollout")
        self.registry = m.registry
        self.rollouts_started = m.counter("rollouts_started_total", "Rollouts started.")
        self.rollouts_running = m.gauge("rollouts_running", "Rollouts running now.")
        self.rollouts_finished = m.counter(
            "rollouts_finished_total",
            "Rollouts finished, by status (completed, truncated, aborted) and, for aborted "
            "ones, the failure layer (sandbox_create, inference, tool_exec, reward, cancelled).",
            ["status", "layer"],
        )
        self.groups_emitted = m.counter(
            "groups_emitted_total", "Groups written for consumers, by sampler.", ["sampler"]
        )
        self.groups_dropped = m.counter(
            "groups_dropped_total",
            "Groups the filter dropped (no signal), by sampler.",
            ["sampler"],
        )
        self.step_seconds = m.histogram(
            "step_seconds",
            "Latency of one agent step part: a model call (part=model) or a tool execution in "
            "the sandbox (part=tool).",
            ["part"],
            buckets=_STEP_BUCKETS,
        )
        self.rollout_seconds = m.histogram(
            "rollout_seconds",
            "Wall-clock time of one rollout, sandbox creation to scoring.",
            buckets=_ROLLOUT_BUCKETS,
        )
        self.jobs_running = m.gauge("jobs_running", "Jobs this process is running now.")
        self.jobs_adopted = m.counter(
            "jobs_adopted_total",
            "Jobs this process took over from a process that stopped or died (resumed, or "
            "marked FAILED when it cannot resume them).",
        )
        self.lease_renewals = m.counter(
            "lease_renewals_total",
            "New leases this process took after its lease was lost (etcd away longer than the "
            "lease's TTL, or the process too busy to refresh it); its running jobs are claimed "
            "again on the new one.",
        )
        self.jobs_removed = m.counter(
            "jobs_removed_total",
            "Ended jobs this process removed from etcd, with their groups, after the "
            "retention (jobs.retention_s).",
        )
        self.job_watch_restarts = m.counter(
            "job_watch_restarts_total",
            "Times the watch over jobs and groups was opened again: resumed (from the revision "
            "it had reached) or relisted (that revision was compacted).",
            ["how"],
        )
        self.job_engines = m.gauge(
            "job_policy_engines",
            "Local engines running now for policies that jobs brought in their specs.",
        )

    def started(self) -> None:
        self.rollouts_started.inc()
        self.rollouts_running.inc()

    def finished(self, record: RolloutRecord) -> None:
        self.rollouts_running.dec()
        layer = record.failure.layer.value if record.failure is not None else ""
        self.rollouts_finished.labels(record.status.value, layer).inc()
        for call in record.calls:
            self.step_seconds.labels("model").observe(call.latency_s)
        for event in record.tool_events:
            self.step_seconds.labels("tool").observe(event.latency_s)
        if record.ended_at:
            self.rollout_seconds.observe(max(0.0, record.ended_at - record.started_at))
