"""One way to run an Orchard gRPC service: health, reflection, errors, metrics, graceful drain.

Two entry points:

- :func:`run_service` for a service's ``main()``: parses the command line, loads configuration
  (:mod:`orchard.core.config`), configures JSON logging, starts the server, marks it ready, and
  drains on SIGTERM/SIGINT. Returns the exit status (0 after a drain, 2 for bad configuration,
  1 when the server cannot start)::

      def main() -> None:
          sys.exit(run_service("inagent", AgentConfig, lambda config: [
              ServiceBinding.servicer(
                  "orchard.inagent.v1.AgentService",
                  agent_service_pb2_grpc.add_AgentServiceServicer_to_server,
                  AgentServicer(config),
              ),
          ]))

- :class:`GrpcServer`, an async context manager for tests and embedding::

      async with GrpcServer("inagent", bindings, config.server) as server:
          await server.set_serving()
          channel = grpc.aio.insecure_channel(server.addresses[0])

With ``server.tls_cert_file`` and ``server.tls_key_file`` set, TCP listeners serve TLS (and,
with ``server.tls_client_ca_file``, require client certificates); Unix sockets stay plaintext,
guarded by their file mode (``server.unix_socket_mode``). See :mod:`orchard.core.tls`.

Every server serves the stock ``grpc.health.v1.Health`` and reflection
(``grpc.reflection.v1alpha``) for its services, health and reflection itself. Health says
NOT_SERVING, for ``""`` and each service, until :meth:`GrpcServer.set_serving` and again from
the moment a drain starts. Handlers raise :class:`orchard.core.errors.OrchardError`; the
:class:`~orchard.core.errors.ErrorInterceptor` turns it into a status with ``ErrorInfo``, and
refuses requests that do not parse with INVALID_ARGUMENT (after the binding's ``authenticate``
check) instead of grpc's UNKNOWN and a logged traceback per call.

Drain on stop: health goes NOT_SERVING (open health ``Watch`` streams get that update and end),
the listeners close so new calls are refused, in-flight calls get up to ``grace_period_s`` to
finish, the rest are cancelled, ``on_stop`` runs, Unix socket files are removed. A second
signal during a drain cancels the remaining calls at once.

Importing this module costs little beyond ``grpc``: health, reflection, pydantic and
prometheus_client load only when a server starts or a configuration is loaded, and
prometheus_client only when metrics are enabled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc

from orchard.core.addresses import ListenAddress, parse_listen_address
from orchard.core.errors import Authenticate, ErrorInterceptor

if TYPE_CHECKING:
    from orchard.core.config_sources import ConfigFlag
    from orchard.core.metrics import MetricsEndpoint, ServiceMetrics

__all__ = [
    "Application",
    "ConfigLoader",
    "GrpcServer",
    "ServerHook",
    "ServerSettings",
    "ServiceBinding",
    "ServiceSettings",
    "application_server",
    "run_application",
    "run_service",
]

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
# Open Watch streams have this long to deliver NOT_SERVING before a drain ends them.
_WATCH_FAREWELL_S = 0.1

ServerHook = Callable[["GrpcServer"], Awaitable[None]]
"""An async callback given the server: ``on_start`` (after binding) or ``on_stop`` (after drain)."""


class ServerSettings(Protocol):
    """What GrpcServer reads from its configuration.

    :class:`orchard.core.config.ServerConfig` (validated, pydantic) is the usual one; any
    object with these attributes will do, for a process that must start without pydantic.
    """

    @property
    def listen(self) -> Sequence[str]: ...
    @property
    def grace_period_s(self) -> float: ...
    @property
    def max_concurrent_rpcs(self) -> int: ...
    @property
    def max_message_bytes(self) -> int: ...
    @property
    def metrics_address(self) -> str | None: ...
    @property
    def unix_socket_mode(self) -> int: ...
    @property
    def tls_cert_file(self) -> str | None: ...
    @property
    def tls_key_file(self) -> str | None: ...
    @property
    def tls_client_ca_file(self) -> str | None: ...


class _RunSettings(ServerSettings, Protocol):
    @property
    def log_level(self) -> str: ...


class ServiceSettings(Protocol):
    """What :func:`run_service` reads from a service's configuration: its ``server`` section.

    A :class:`orchard.core.config.ServiceConfig` is one; so is a plain dataclass with a
    :class:`~orchard.core.config_sources.PlainServerConfig` ``server`` field.
    """

    @property
    def server(self) -> _RunSettings: ...


C = TypeVar("C", bound=ServiceSettings)

ConfigLoader = Callable[[argparse.Namespace, Mapping[str, str], str], C]
"""Builds a service's configuration from the parsed command line, the environment and the
service's environment prefix; raises :class:`~orchard.core.config_sources.ConfigError`."""


@dataclass(frozen=True)
class ServiceBinding:
    """One gRPC service to serve: its full name (for health and reflection) and how to add it."""

    name: str
    """Full service name, e.g. ``orchard.inagent.v1.AgentService``."""
    register: Callable[[grpc.aio.Server], None]
    """Adds the service's handlers to a server (called once, before it starts)."""
    authenticate: Authenticate | None = None
    """The service's credential check, run before a request that does not parse is refused
    (so unauthenticated garbage gets UNAUTHENTICATED); None: the service has none."""

    @classmethod
    def servicer(
        cls,
        name: str,
        add_to_server: Callable[[Any, grpc.aio.Server], None],
        servicer: object,
        authenticate: Authenticate | None = None,
    ) -> ServiceBinding:
        """Bind a generated ``add_XServicer_to_server`` function and a servicer instance;
        ``authenticate`` defaults to the servicer's ``authenticate(context)`` method if any."""
        if authenticate is None:
            authenticate = getattr(servicer, "authenticate", None)
        return cls(name, lambda server: add_to_server(servicer, server), authenticate)

    @classmethod
    def generic(cls, handler: grpc.GenericRpcHandler, name: str | None = None) -> ServiceBinding:
        """Bind a generic handler, e.g. from ``grpc.method_handlers_generic_handler``."""
        service_name = name if name is not None else handler.service_name()
        if not service_name:
            raise ValueError("generic handler has no service name; pass name=")
        return cls(service_name, lambda server: server.add_generic_rpc_handlers((handler,)))


class GrpcServer:
    """A grpc.aio server with health, reflection, error translation, metrics and drain.

    Use ``async with`` (or :meth:`start` and :meth:`stop`). ``config`` defaults to
    ``ServerConfig()`` (127.0.0.1 on a free port, no metrics).

    ``deferred``: :meth:`start` runs ``on_start`` without making the gRPC server; the first
    :meth:`open` makes it, binds and serves (a process that serves its callers another way
    until asked pays neither grpc's start nor its idle threads' wake-ups).
    """

    def __init__(
        self,
        service: str,
        services: Sequence[ServiceBinding],
        config: ServerSettings | None = None,
        *,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        on_start: ServerHook | None = None,
        on_stop: ServerHook | None = None,
        deferred: bool = False,
    ) -> None:
        if config is None:
            from orchard.core.config import ServerConfig  # noqa: PLC0415

            config = ServerConfig()
        self.service = service
        self.config: ServerSettings = config
        self._bindings = list(services)
        self._interceptors = list(interceptors)
        self._on_start = on_start
        self._on_stop = on_stop
        self._server: grpc.aio.Server | None = None
        self._deferred = deferred
        self._started = False
        self._opening = asyncio.Lock()
        self._serving_wanted: bool | None = None
        self._health: Any = None
        self._addresses: list[str] = []
        self._unix_paths: list[Path] = []
        self._draining = asyncio.Event()
        self._stop_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self.metrics: ServiceMetrics | None = None
        """The server's metrics (registry, RPC metrics), or None when metrics are disabled."""
        self._metrics_endpoint: MetricsEndpoint | None = None

    # -- properties --------------------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        """Bound addresses, as clients dial them: ``127.0.0.1:41234``, ``unix:/run/a.sock``."""
        return list(self._addresses)

    @property
    def port(self) -> int:
        """The port of the first TCP address (handy with port 0); error if none is TCP."""
        for address in self._addresses:
            parsed = parse_listen_address(address)
            if not parsed.is_unix:
                return parsed.port
        raise RuntimeError("server has no TCP address")

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` of the bound /metrics endpoint, or None when metrics are disabled."""
        return self._metrics_endpoint.address if self._metrics_endpoint else None

    @property
    def service_names(self) -> list[str]:
        """Full names of the services bound (without health and reflection)."""
        return [binding.name for binding in self._bindings]

    @property
    def draining(self) -> bool:
        """True from the moment :meth:`stop` begins."""
        return self._draining.is_set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind every address, start serving (health NOT_SERVING), then run ``on_start``;
        when deferred, only run ``on_start``."""
        if self._started:
            raise RuntimeError("server already started")
        self._started = True
        try:
            if not self._deferred:
                await self._open()
            if self._on_start is not None:
                await self._on_start(self)
        except BaseException:
            await self.stop(grace=0)
            raise
        if self._deferred:
            log.info("started; gRPC on demand", extra={"listen": list(self.config.listen)})

    @property
    def opened(self) -> bool:
        """Whether the gRPC server is made and serving (always, once started, unless
        deferred)."""
        return self._server is not None

    async def open(self) -> list[str]:
        """Make, bind and start the gRPC server of a deferred server (at once if it serves
        already); returns the bound addresses. Health turns SERVING here when the server was
        declared serving before. OSError when an address cannot be bound (nothing is left
        bound: a later call tries again); RuntimeError once the server is stopping."""
        if not self._started:
            raise RuntimeError("server not started")
        async with self._opening:
            if self._draining.is_set():
                raise RuntimeError("server is stopping")
            if self._server is None:
                await self._open()
                if self._serving_wanted is not None:
                    await self.set_serving(self._serving_wanted)
        return self.addresses

    async def _open(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415
        from grpc_health.v1.health import aio as health_aio  # noqa: PLC0415
        from grpc_reflection.v1alpha import reflection  # noqa: PLC0415

        interceptors: list[Any] = []
        if self.config.metrics_address is not None:
            from orchard.core.metrics import MetricsInterceptor, ServiceMetrics  # noqa: PLC0415

            self.metrics = ServiceMetrics(self.service)
            interceptors.append(MetricsInterceptor(self.metrics))
        authenticators = {b.name: b.authenticate for b in self._bindings if b.authenticate}
        interceptors.append(ErrorInterceptor(authenticators))
        interceptors += self._interceptors

        limit = self.config.max_concurrent_rpcs
        server = grpc.aio.server(
            interceptors=interceptors,
            maximum_concurrent_rpcs=limit,
            options=[
                ("grpc.server.max_pending_requests", limit),
                ("grpc.server.max_pending_requests_hard_limit", limit * 2),
                ("grpc.max_receive_message_length", self.config.max_message_bytes),
                ("grpc.max_send_message_length", self.config.max_message_bytes),
                ("grpc.so_reuseport", 0),  # a port already in use must fail, not be shared
            ],
        )
        for binding in self._bindings:
            binding.register(server)
        self._health = health_aio.HealthServicer()
        # Wrapped in place rather than by an interceptor, which would run on every call.
        self._health.Watch = _ending_on_drain(self._health.Watch, self._draining)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        for name in ("", *self.service_names):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(
            (*self.service_names, HEALTH_SERVICE, reflection.SERVICE_NAME), server
        )

        try:
            credentials = self._tls_credentials()
            for text in self.config.listen:
                address = parse_listen_address(text)
                self._addresses.append(self._bind(server, address, credentials))
            await server.start()
            for path in self._unix_paths:
                os.chmod(path, self.config.unix_socket_mode)
            if self.metrics is not None and self.config.metrics_address is not None:
                from orchard.core.metrics import MetricsEndpoint  # noqa: PLC0415

                self._metrics_endpoint = MetricsEndpoint(
                    self.config.metrics_address, self.metrics.registry
                )
                self._metrics_endpoint.start()
        except BaseException:
            await server.stop(0)
            self._remove_unix_sockets()
            self._addresses, self._unix_paths, self._health = [], [], None
            raise
        self._server = server
        log.info(
            "serving",
            extra={
                "addresses": self.addresses,
                "metrics_address": self.metrics_address,
                "tls": self.tls,
            },
        )

    @property
    def tls(self) -> str:
        """How TCP listeners are secured: ``"off"``, ``"tls"`` or ``"mutual"`` (client
        certificates required). Unix sockets are plaintext either way."""
        if not self.config.tls_cert_file:
            return "off"
        return "mutual" if self.config.tls_client_ca_file else "tls"

    def _tls_credentials(self) -> grpc.ServerCredentials | None:
        cert, key = self.config.tls_cert_file, self.config.tls_key_file
        if not cert and not key:
            return None
        from orchard.core.tls import server_credentials, tls_pairing_problem  # noqa: PLC0415

        # A validated ServerConfig has been checked already; a plain settings object has not.
        problem = tls_pairing_problem(cert, key, self.config.tls_client_ca_file)
        if problem is not None or not cert or not key:
            raise ValueError(f"server: {problem}")
        return server_credentials(cert, key, self.config.tls_client_ca_file)

    def _bind(
        self,
        server: grpc.aio.Server,
        address: ListenAddress,
        credentials: grpc.ServerCredentials | None,
    ) -> str:
        if address.unix_path is not None:
            path = Path(address.unix_path)
            _prepare_unix_socket(path)
            self._bind_port(server, address, None)  # plaintext: guarded by the socket's mode
            self._unix_paths.append(path)
            return address.grpc_target()
        port = self._bind_port(server, address, credentials)
        return address.with_port(port).grpc_target()

    @staticmethod
    def _bind_port(
        server: grpc.aio.Server,
        address: ListenAddress,
        credentials: grpc.ServerCredentials | None,
    ) -> int:
        try:
            if credentials is None:
                port = server.add_insecure_port(address.grpc_target())
            else:
                port = server.add_secure_port(address.grpc_target(), credentials)
        except RuntimeError as exc:
            raise OSError(errno.EADDRNOTAVAIL, f"cannot listen on {address}: {exc}") from None
        if port == 0 and not address.is_unix:
            raise OSError(errno.EADDRINUSE, f"cannot listen on {address} (in use?)")
        return int(port)

    async def set_serving(self, serving: bool = True) -> None:
        """Declare the server ready (SERVING) or not, for ``""`` and every bound service.

        Ignored once a drain has started: from then on health stays NOT_SERVING. A deferred
        server not open yet takes it when it opens.
        """
        if self._health is None:
            if self._deferred and self._started:
                self._serving_wanted = serving
                return
            raise RuntimeError("server not started")
        from grpc_health.v1 import health_pb2  # noqa: PLC0415

        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self._health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop; ``grace`` defaults to ``config.grace_period_s``. Idempotent.

        A second call with a smaller grace (e.g. 0 on a second signal) cuts the drain short.
        """
        if grace is None:
            grace = self.config.grace_period_s
        if self._stop_task is None:
            self._stop_task = asyncio.create_task(self._drain(grace))
        elif self._server is not None and not self._stop_task.done():
            await self._server.stop(grace)
        await asyncio.shield(self._stop_task)

    async def _drain(self, grace: float) -> None:
        started = time.monotonic()
        try:
            if self._deferred:
                # An open under way finishes first (and is drained); none starts after this.
                self._draining.set()
                async with self._opening:
                    pass
            if self._health is not None:
                await self._health.enter_graceful_shutdown()
            self._draining.set()
            if self._server is not None:
                log.info("draining", extra={"grace_period_s": grace})
                await self._server.stop(grace)
            if self._on_stop is not None and self._started:
                await self._on_stop(self)
        finally:
            if self._metrics_endpoint is not None:
                await asyncio.to_thread(self._metrics_endpoint.stop)
            self._remove_unix_sockets()
            self._stopped.set()
            log.info("stopped", extra={"drain_s": round(time.monotonic() - started, 3)})

    def _remove_unix_sockets(self) -> None:
        for path in self._unix_paths:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()

    async def wait_for_termination(self) -> None:
        """Return once the server has stopped."""
        await self._stopped.wait()

    async def __aenter__(self) -> GrpcServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


def _prepare_unix_socket(path: Path) -> None:
    """Create the parent directory; remove a stale socket, refuse to replace a live one."""
    if len(os.fsencode(path)) >= 108:
        raise OSError(errno.ENAMETOOLONG, f"unix socket path too long (max 107 bytes): {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(os.fspath(path))
    except OSError:
        path.unlink()  # nobody listens: a leftover from a process that died
    else:
        raise OSError(errno.EADDRINUSE, f"{path}: another process is serving on this socket")
    finally:
        probe.close()


def _ending_on_drain(watch: Callable[..., Any], draining: asyncio.Event) -> Callable[..., Any]:
    """Health ``Watch`` that ends (OK) when a drain starts, so open streams do not hold it up."""

    async def watch_until_drain(request: Any, context: grpc.aio.ServicerContext) -> None:
        task = asyncio.ensure_future(watch(request, context))
        waiter = asyncio.ensure_future(draining.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()  # type: ignore[no-any-return]
            await asyncio.wait({task}, timeout=_WATCH_FAREWELL_S)
        finally:
            waiter.cancel()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return None

    return watch_until_drain


# ---------------------------------------------------------------------------------------------
# main() helper


def run_service(
    service: str,
    config_cls: type[C] | ConfigLoader[C],
    services: Callable[[C], Sequence[ServiceBinding]],
    *,
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    description: str | None = None,
    flags: Sequence[ConfigFlag] | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    on_start: Callable[[C, GrpcServer], Awaitable[None]] | None = None,
    on_stop: Callable[[C, GrpcServer], Awaitable[None]] | None = None,
    ready_on_start: bool = True,
    deferred: Callable[[C], bool] | None = None,
) -> int:
    """Run a service until SIGTERM/SIGINT; return the process exit status.

    ``services(config)`` builds the bindings; ``on_start(config, server)`` runs after the
    server is bound (start background work there), ``on_stop(config, server)`` after the
    drain. With ``ready_on_start`` the server declares itself SERVING once ``on_start``
    returns; otherwise the service calls ``server.set_serving()`` itself when ready.
    When ``deferred(config)`` is true the gRPC server is made on demand
    (:meth:`GrpcServer.open`, see ``deferred`` there).
    Command line: ``--config FILE``, ``--set KEY=VALUE`` and ``flags`` (default
    :data:`orchard.core.config.SERVER_FLAGS`).

    ``config_cls`` is the service's :class:`~orchard.core.config.ServiceConfig` subclass, or a
    :data:`ConfigLoader` for a service that must start without pydantic (see
    :mod:`orchard.core.config_sources`).
    """
    from orchard.core.config_sources import (  # noqa: PLC0415
        SERVER_FLAGS,
        ConfigError,
        add_config_arguments,
        service_env_prefix,
    )
    from orchard.core.logging import configure_logging  # noqa: PLC0415

    program = f"orchard-{service}"
    parser = argparse.ArgumentParser(prog=program, description=description)
    add_config_arguments(
        parser, SERVER_FLAGS if flags is None else flags, env_prefix=service_env_prefix(service)
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    env_prefix = service_env_prefix(service)
    config: C
    try:
        if isinstance(config_cls, type):
            from orchard.core.config import config_from_args  # noqa: PLC0415

            config = config_from_args(config_cls, args, env=env, env_prefix=env_prefix)
        else:
            config = config_cls(args, os.environ if env is None else env, env_prefix)
    except ConfigError as exc:
        print(f"{program}: {exc}", file=sys.stderr)
        return 2
    configure_logging(service, config.server.log_level)

    async def hook_start(server: GrpcServer) -> None:
        if on_start is not None:
            await on_start(config, server)

    async def hook_stop(server: GrpcServer) -> None:
        if on_stop is not None:
            await on_stop(config, server)

    async def serve() -> int:
        stop_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        cutoffs: list[asyncio.Task[None]] = []
        server: GrpcServer | None = None

        def on_signal(signum: int) -> None:
            name = signal.Signals(signum).name
            if not stop_requested.is_set():
                log.info("signal received, draining", extra={"signal": name})
                stop_requested.set()
            elif server is not None:
                log.warning("second signal, cancelling remaining calls", extra={"signal": name})
                cutoffs.append(loop.create_task(server.stop(grace=0)))

        # Installed before binding, so a signal during startup drains instead of killing.
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            try:
                server = GrpcServer(
                    service,
                    services(config),
                    config.server,
                    interceptors=interceptors,
                    on_start=hook_start,
                    on_stop=hook_stop,
                    deferred=deferred is not None and deferred(config),
                )
                await server.start()
            except Exception:
                log.exception("cannot start %s", program)
                return 1
            try:
                if ready_on_start and not stop_requested.is_set():
                    await server.set_serving()
                await stop_requested.wait()
            finally:
                await server.stop()
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
        return 0

    return asyncio.run(serve())


class Application(Protocol):
    """A service's running parts around its gRPC server: what it serves (``bindings``), what
    it starts once the server is bound (``start``: stores, clients, background loops) and
    stops after the drain (``stop``). :func:`run_application` drives one in its process;
    :func:`application_server` wraps one in a :class:`GrpcServer` for tests and embedding."""

    def bindings(self) -> list[ServiceBinding]: ...

    async def start(self, server: GrpcServer) -> None: ...

    async def stop(self) -> None: ...


def application_server(
    service: str, application: Application, config: ServerSettings
) -> GrpcServer:
    """A server that starts ``application`` after binding and stops it after the drain."""

    async def on_start(server: GrpcServer) -> None:
        await application.start(server)

    async def on_stop(server: GrpcServer) -> None:
        await application.stop()

    return GrpcServer(service, application.bindings(), config, on_start=on_start, on_stop=on_stop)


def run_application(
    service: str,
    config_cls: type[C] | ConfigLoader[C],
    make_application: Callable[[C], Application],
    *,
    description: str | None = None,
    flags: Sequence[ConfigFlag] | None = None,
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """:func:`run_service` for an :class:`Application` built from the one validated config."""
    built: list[Application] = []

    def services(config: C) -> list[ServiceBinding]:
        built.append(make_application(config))
        return built[0].bindings()

    async def on_start(config: C, server: GrpcServer) -> None:
        await built[0].start(server)

    async def on_stop(config: C, server: GrpcServer) -> None:
        if built:
            await built[0].stop()

    return run_service(
        service,
        config_cls,
        services,
        argv=argv,
        env=env,
        description=description,
        flags=flags,
        on_start=on_start,
        on_stop=on_stop,
    )
