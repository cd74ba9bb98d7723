"""The service's own Prometheus metrics, in the server's registry (``orchard_env_*``).

Exec is the hot path: :class:`ExecObservation` records a call with a label child looked up
once per status code and an in-flight count read only when scraped, not per call.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import grpc

from orchard.core.errors import OrchardError
from orchard.core.metrics import ServiceMetrics
from orchard.env.v1 import env_pb2

__all__ = ["EnvMetrics", "ExecObservation"]

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
        self.execs_running = 0
        """Exec and ExecStream calls in flight; the gauge reads it when scraped."""
        self.execs_in_flight.set_function(lambda: self.execs_running)
        self._exec_by_code: dict[str, Any] = {}
        self._state_gauges = {
            value: self.sandboxes.labels(
                state=env_pb2.SandboxState.Name(value).removeprefix("SANDBOX_STATE_")
            )
            for value in env_pb2.SandboxState.values()
            if value != env_pb2.SANDBOX_STATE_UNSPECIFIED
        }
        for gauge in self._state_gauges.values():
            gauge.set(0)

    def set_state_counts(self, states: Iterable[int]) -> None:
        tally = Tally(states)
        for value, gauge in self._state_gauges.items():
            gauge.set(tally.get(value, 0))

    def exec_observation(self) -> ExecObservation:
        """Times one Exec or ExecStream: ``with metrics.exec_observation(): ...`` (or
        ``async with``)."""
        return ExecObservation(self)

    def observe_exec(self, code: str, seconds: float) -> None:
        """Record one finished exec in ``exec_seconds`` under ``code``."""
        child = self._exec_by_code.get(code)
        if child is None:
            child = self._exec_by_code[code] = self.exec_seconds.labels(code=code)
        child.observe(seconds)


class ExecObservation:
    """One exec through the service: counted in flight, then timed under its status code
    (a gRPC code name, ``AGENT_ERROR`` for the agent's own status, ``CANCELLED``)."""

    __slots__ = ("_metrics", "_started")

    def __init__(self, metrics: EnvMetrics) -> None:
        self._metrics = metrics
        self._started = 0.0

    # Nothing here awaits: the plain protocol spares the hot path two coroutines per call.
    def __enter__(self) -> ExecObservation:
        self._started = time.monotonic()
        self._metrics.execs_running += 1
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        metrics = self._metrics
        metrics.execs_running -= 1
        if exc is None:
            code = "OK"
        elif isinstance(exc, OrchardError):
            code = exc.code.name
        elif isinstance(exc, grpc.aio.AbortError):
            code = "AGENT_ERROR"
        else:
            code = "CANCELLED"
        metrics.observe_exec(code, time.monotonic() - self._started)

    async def __aenter__(self) -> ExecObservation:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, traceback)
