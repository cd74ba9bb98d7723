"""Prometheus metrics: a per-server registry, RPC metrics, and the ``/metrics`` HTTP endpoint.

Names follow ``orchard_<service>_<what>_<unit>``; counters end in ``_total``. Each
:class:`ServiceMetrics` owns its own ``CollectorRegistry`` (never the process-global one), so
several servers in one process or test do not collide.

Every server with metrics enabled records, per RPC:

- ``orchard_<service>_rpc_seconds`` — histogram of call duration, labels ``method``
  (``/package.Service/Method``) and ``code`` (``OK``, ``NOT_FOUND``, ...),
- ``orchard_<service>_rpc_in_flight`` — gauge of calls running now, label ``method``.

A service adds its own metrics to the same registry::

    exec_seconds = metrics.histogram("exec_seconds", "Time to run one command.")

This module imports ``prometheus_client``; :mod:`orchard.core.server` imports it only when
metrics are enabled, so a service that runs without metrics never pays for it.
"""

from __future__ import annotations

import asyncio
import re
import socket
import socketserver
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from orchard.core._handlers import wrap_handler
from orchard.core.addresses import parse_listen_address

__all__ = ["RPC_SECONDS_BUCKETS", "MetricsEndpoint", "MetricsInterceptor", "ServiceMetrics"]

RPC_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0,
)  # fmt: skip
"""Buckets of ``rpc_seconds``: sub-millisecond loopback calls up to long exec streams."""

_NAME_PART = re.compile(r"^[a-z][a-z0-9_]*$")


class ServiceMetrics:
    """The metrics of one service instance, in a registry of its own."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        if not _NAME_PART.match(service):
            raise ValueError(f"service name {service!r}: use lowercase letters, digits and _")
        self.service = service
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rpc_seconds = self.histogram(
            "rpc_seconds",
            "Duration of gRPC calls handled, by method and status code.",
            ["method", "code"],
            buckets=RPC_SECONDS_BUCKETS,
        )
        self.rpc_in_flight = self.gauge(
            "rpc_in_flight", "gRPC calls being handled now, by method.", ["method"]
        )

    def name(self, what_unit: str) -> str:
        """The full metric name: ``orchard_<service>_<what_unit>``."""
        if not _NAME_PART.match(what_unit):
            raise ValueError(f"metric name part {what_unit!r}: use lowercase letters, digits, _")
        return f"orchard_{self.service}_{what_unit}"

    def histogram(
        self,
        what_unit: str,
        documentation: str,
        labels: Sequence[str] = (),
        *,
        buckets: Sequence[float] = Histogram.DEFAULT_BUCKETS,
    ) -> Histogram:
        """Register a histogram named ``orchard_<service>_<what_unit>`` (e.g. ``exec_seconds``)."""
        return Histogram(
            self.name(what_unit), documentation, labels, registry=self.registry, buckets=buckets
        )

    def counter(self, what_total: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        """Register a counter; the name ends in ``_total`` (e.g. ``sandboxes_created_total``)."""
        if not what_total.endswith("_total"):
            raise ValueError(f"counter {what_total!r}: counter names end in _total")
        return Counter(self.name(what_total), documentation, labels, registry=self.registry)

    def gauge(self, what_unit: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        """Register a gauge named ``orchard_<service>_<what_unit>``."""
        return Gauge(self.name(what_unit), documentation, labels, registry=self.registry)


class MetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Records ``rpc_seconds`` and ``rpc_in_flight`` for every call, all four RPC kinds.

    Install it outermost (first), so the code it records is the one the client receives.
    """

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self, continuation: Any, handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return wrap_handler(handler, handler_call_details.method, self._observe)

    @asynccontextmanager
    async def _observe(self, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        in_flight = self._metrics.rpc_in_flight.labels(method)
        in_flight.inc()
        started = time.perf_counter()
        code = grpc.StatusCode.UNKNOWN
        try:
            yield
            code = context.code() or grpc.StatusCode.OK
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except BaseException:
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        finally:
            in_flight.dec()
            self._metrics.rpc_seconds.labels(method, _code_name(code)).observe(
                time.perf_counter() - started
            )


def _code_name(code: Any) -> str:
    if isinstance(code, grpc.StatusCode):
        return str(code.name)
    for member in grpc.StatusCode:  # some grpc versions report the raw integer
        if member.value[0] == code:
            return str(member.name)
    return str(code)


class MetricsEndpoint:
    """The HTTP server answering ``GET /metrics`` for one registry, on its own thread."""

    def __init__(self, address: str, registry: CollectorRegistry) -> None:
        parsed = parse_listen_address(address)
        if parsed.is_unix:
            raise ValueError(f"metrics address {address!r}: must be HOST:PORT")
        self._host = parsed.host
        self._requested_port = parsed.port
        self._registry = registry
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and start serving; :attr:`port` is then the bound port."""
        server_class = _Http6Server if ":" in self._host else _HttpServer
        self._server = make_server(
            self._host,
            self._requested_port,
            make_wsgi_app(self._registry),
            server_class=server_class,
            handler_class=_QuietHandler,
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},  # how long stop() waits for the loop to notice
            name="metrics-http",
            daemon=True,
        )
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound port (only after :meth:`start`)."""
        if self._server is None:
            raise RuntimeError("metrics endpoint not started")
        return int(self._server.server_port)

    @property
    def address(self) -> str:
        """``host:port`` actually bound, for logs and scrapers."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self.port}"

    def stop(self) -> None:
        """Stop serving and release the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class _HttpServer(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per scrape, so a slow scraper does not block the next."""

    daemon_threads = True


class _Http6Server(_HttpServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr: it would break the one-JSON-object-per-line log stream."""

    def log_message(self, format: str, *args: Any) -> None:
        pass
