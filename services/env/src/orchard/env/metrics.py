"""The service's own Prometheus metrics, in the server's registry (``orchard_env_*``)."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable

from orchard.core.metrics import ServiceMetrics
from orchard.env.v1 import env_pb2

__all__ = ["EnvMetrics"]

_LIFECYCLE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_EXEC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_STATES = [
    env_pb2.SandboxState.Name(v).removeprefix("SANDBOX_STATE_")
    for v in env_pb2.SandboxState.values()
    if v != env_pb2.SANDBOX_STATE_UNSPECIFIED
]


class EnvMetrics:
    """``orchard_env_*``: sandbox counts, lifecycle and exec latencies, reaps and failures.

    Without a metrics address the server has no registry; then these go to a private one that
    nobody scrapes, so the code that records them needs no conditions.
    """

    def __init__(self, metrics: ServiceMetrics | None) -> None:
        self.registry_owner = metrics if metrics is not None else ServiceMetrics("env")
        m = self.registry_owner
        self.sandboxes = m.gauge(
            "sandboxes",
            "Sandbox records in the state store, by state (every replica reports all of them).",
            ["state"],
        )
        self.create_seconds = m.histogram(
            "create_seconds",
            "CreateSandbox handling time: validation and the record write.",
            buckets=_LIFECYCLE_BUCKETS,
        )
        self.ready_seconds = m.histogram(
            "ready_seconds",
            "From CreateSandbox to READY (the runtime's start, by the replica that ran it).",
            buckets=_LIFECYCLE_BUCKETS,
        )
        self.exec_seconds = m.histogram(
            "exec_seconds",
            "Exec and ExecStream through the service, lock wait included, by status code.",
            ["code"],
            buckets=_EXEC_BUCKETS,
        )
        self.delete_seconds = m.histogram(
            "delete_seconds",
            "DeleteSandbox: runtime release and record removal.",
            buckets=_LIFECYCLE_BUCKETS,
        )
        self.reaped = m.counter(
            "sandboxes_reaped_total",
            "Sandboxes whose runtime resources were released after their lease expired.",
        )
        self.failed = m.counter(
            "sandboxes_failed_total", "Sandboxes that went to FAILED, by reason.", ["reason"]
        )
        self.leftovers = m.counter(
            "leftovers_deleted_total",
            "Runtime sandboxes without a record, deleted by reconciliation.",
        )
        self.execs_in_flight = m.gauge(
            "execs_in_flight", "Exec and ExecStream calls running through this replica."
        )
        for state in _STATES:
            self.sandboxes.labels(state=state).set(0)

    def set_state_counts(self, states: Iterable[int]) -> None:
        tally = Tally(states)
        for value in env_pb2.SandboxState.values():
            if value == env_pb2.SANDBOX_STATE_UNSPECIFIED:
                continue
            name = env_pb2.SandboxState.Name(value).removeprefix("SANDBOX_STATE_")
            self.sandboxes.labels(state=name).set(tally.get(value, 0))
