"""The async client: :class:`AsyncSandboxClient` and its sandbox handle :class:`AsyncSandbox`.

This is the core; :mod:`orchard.sdk.sync` runs it for blocking code. Example::

    from orchard.sdk import AsyncSandboxClient

    async with AsyncSandboxClient() as client:          # endpoint/token from env or profile
        async with client.create(image="host", labels={"task": "demo"}) as sandbox:
            result = await sandbox.exec(["echo", "hi"])
            print(result.check().stdout_text)
        # the sandbox is deleted here

What it does for you:

- retries UNAVAILABLE with exponential backoff and full jitter on calls that are safe to
  repeat (reads; creates and deletes, which reuse one ``request_id`` on every attempt); never
  retries ``exec``, since the command may already have run,
- maps every failure to a typed exception (:mod:`orchard.sdk.errors`),
- heartbeats each sandbox it created at a third of its heartbeat timeout while the handle is
  open, so the service does not reap it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import shlex
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc

from orchard.env.v1 import env_pb2, env_service_pb2, env_service_pb2_grpc
from orchard.inagent.v1 import inagent_service_pb2
from orchard.sdk import errors
from orchard.sdk.agent_route import REFUSED_BEFORE_RUNNING, AgentRoutes
from orchard.sdk.connection import ConnectionSettings, resolve_connection
from orchard.sdk.retry import RetryPolicy
from orchard.sdk.types import (
    EgressRule,
    ExecEvent,
    ExecExit,
    ExecResult,
    FileInfo,
    FileType,
    Resources,
    SandboxInfo,
    SandboxState,
    duration,
    exec_event_from_proto,
)
from orchard.types.v1 import exec_pb2

__all__ = ["AsyncSandbox", "AsyncSandboxClient", "SandboxCreation", "TransferProgress"]

log = logging.getLogger(__name__)

T = TypeVar("T")

TransferProgress = Callable[[int, int], None]
"""Called as ``progress(bytes_done, bytes_total)`` while files move."""

CHUNK_BYTES = 1 << 20
"""Size of each WriteFile data message (well under gRPC's 4 MiB default message cap)."""

_DEFAULT_CALL_TIMEOUT_S = 30.0
_DEFAULT_WAIT_TIMEOUT_S = 600.0
_DEFAULT_HEARTBEAT_TIMEOUT_S = 300.0
_EXEC_DEADLINE_MARGIN_S = 30.0
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Reconnect quickly after a service restart; gRPC's default backoff grows to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class AsyncSandboxClient:
    """A connection to the environment service.

    ``endpoint`` and ``token`` default to ``$ORCHARD_ENDPOINT``/``$ORCHARD_TOKEN``, then the
    profile ``orchard up`` writes (see :mod:`orchard.sdk.connection`). ``timeout`` is the
    deadline of each quick call in seconds; ``retry`` how UNAVAILABLE is retried.

    TLS: ``tls=True`` or an ``https://`` endpoint; ``tls_ca_file`` (default
    ``$ORCHARD_TLS_CA``) is the CA that signed the server's certificate, the system's roots
    when unset. A token goes in plaintext only to loopback or Unix endpoints unless
    ``allow_insecure=True``.

    ``direct_agent=True`` runs ``exec`` and file reads straight on each sandbox's agent, with a
    short-lived credential for that sandbox from the service (``OpenAgentRoute``), and falls back
    to the service per sandbox when the agent cannot be reached (see
    :mod:`orchard.sdk.agent_route`).
    Off by default: the agent is reachable only from the service's host (local runtime) or
    where the operator's network policy admits the client (Kubernetes).

    Use it as ``async with AsyncSandboxClient() as client:`` or call :meth:`close`.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        token: str | None = None,
        profile: str | os.PathLike[str] | None = None,
        retry: RetryPolicy | None = None,
        timeout: float = _DEFAULT_CALL_TIMEOUT_S,
        tls: bool | None = None,
        tls_ca_file: str | os.PathLike[str] | None = None,
        allow_insecure: bool = False,
        direct_agent: bool = False,
    ) -> None:
        self.settings: ConnectionSettings = resolve_connection(
            endpoint,
            token,
            tls=tls,
            tls_ca_file=tls_ca_file,
            allow_insecure=allow_insecure,
            profile_path=profile,
        )
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {self.settings.token}"),) if self.settings.token else ()
        )
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._sandboxes: set[AsyncSandbox] = set()
        self.routes: AgentRoutes | None = AgentRoutes(self._open_route) if direct_agent else None
        """The direct routes to agents (``direct_agent=True``), else None."""

    async def _open_route(self, sandbox_id: str) -> Any:
        request = env_service_pb2.OpenAgentRouteRequest(sandbox_id=sandbox_id)
        return await self.stub.OpenAgentRoute(
            request, metadata=self._metadata, timeout=self.timeout
        )

    @property
    def endpoint(self) -> str:
        """The gRPC target this client talks to."""
        return self.settings.endpoint

    @property
    def stub(self) -> Any:
        """The generated ``EnvServiceStub`` (for calls this client does not wrap yet)."""
        if self._stub is None:
            # Created on first use, on the running loop: a grpc.aio channel belongs to one loop.
            if self.settings.tls:
                credentials = grpc.ssl_channel_credentials(root_certificates=self.settings.tls_ca)
                self._channel = grpc.aio.secure_channel(
                    self.endpoint, credentials, options=_CHANNEL_OPTIONS
                )
            else:
                self._channel = grpc.aio.insecure_channel(self.endpoint, options=_CHANNEL_OPTIONS)
            self._stub = env_service_pb2_grpc.EnvServiceStub(self._channel)
        return self._stub

    async def __aenter__(self) -> AsyncSandboxClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop every handle's heartbeats (sandboxes are not deleted) and close the channel."""
        for sandbox in list(self._sandboxes):
            await sandbox.close()
        if self.routes is not None:
            await self.routes.close()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None

    # -- calls -------------------------------------------------------------------------------

    async def _unary(
        self,
        method: str,
        request: Any,
        *,
        retry: bool,
        sandbox_call: bool = True,
        deadline: float | None = -1.0,
    ) -> Any:
        """One unary call with retries (when ``retry``) and typed errors; ``deadline`` in
        seconds, -1 for the client's default, None for none."""
        deadline = self.timeout if deadline == -1.0 else deadline
        attempt = 0
        while True:
            try:
                return await getattr(self.stub, method)(
                    request, metadata=self._metadata, timeout=deadline
                )
            except grpc.RpcError as exc:
                if retry and self.retry.should_retry(exc.code(), attempt):
                    await asyncio.sleep(self.retry.backoff(attempt))
                    attempt += 1
                    continue
                raise self._error(exc, method, sandbox_call) from None

    def _error(self, exc: grpc.RpcError, method: str, sandbox_call: bool) -> errors.ServiceError:
        error = errors.from_rpc_error(exc, method=method, sandbox_call=sandbox_call)
        if isinstance(error, errors.Unavailable) and not _has_error_info(exc):
            # The transport failed, not the service: say where we tried to go.
            error.message = (
                f"cannot reach the environment service at {self.endpoint}: {error.message}"
            )
            error.metadata["endpoint"] = self.endpoint
        return error

    async def _retrying(
        self, method: str, attempt_once: Callable[[], Awaitable[T]], *, retry: bool = True
    ) -> T:
        """Retry ``attempt_once`` (a streaming call, or a sequence) on UNAVAILABLE."""
        attempt = 0
        while True:
            try:
                return await attempt_once()
            except grpc.RpcError as exc:
                if retry and self.retry.should_retry(exc.code(), attempt):
                    await asyncio.sleep(self.retry.backoff(attempt))
                    attempt += 1
                    continue
                raise self._error(exc, method, True) from None

    # -- lifecycle ---------------------------------------------------------------------------

    def create(
        self,
        image: str = "host",
        *,
        labels: Mapping[str, str] | None = None,
        resources: Resources | None = None,
        heartbeat_timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        working_dir: str = "",
        owner_id: str = "",
        egress: Sequence[EgressRule] = (),
        ingress_ports: Sequence[int] = (),
        user_namespaces: bool = False,
        raw_sockets: bool = False,
        wait: bool = True,
        wait_timeout: float | None = _DEFAULT_WAIT_TIMEOUT_S,
        keep_alive: bool = True,
        request_id: str | None = None,
    ) -> SandboxCreation:
        """Create a sandbox and (by default) wait until it is READY.

        Await it for a handle, or use it as an async context manager to delete the sandbox on
        exit::

            sandbox = await client.create(image="host", resources=Resources.of(memory="512M"))
            async with client.create(image="host", heartbeat_timeout=60) as sandbox:
                ...

        ``image``: ``"host"``, ``"rootfs:/dir"``, ``"oci-archive:/x.tar"``,
        ``"docker-archive:/x.tar"`` or a registry reference, as the runtime supports.
        ``heartbeat_timeout``: seconds the sandbox survives without a heartbeat (None: the
        service default). ``keep_alive``: heartbeat in the background at a third of that while
        the handle is open. ``wait``: wait for READY (up to ``wait_timeout`` seconds, None for
        no limit); when waiting fails the sandbox is deleted and the error raised
        (:class:`~orchard.sdk.errors.SandboxFailed`, ``DeadlineExceeded``, ...).
        ``egress``: what it may reach (default: nothing); ``ingress_ports``: the ports on which
        sandboxes holding ``EgressRule.to_sandbox(<its id>)`` may reach it, at
        ``info.network_address`` (fixed for its life). ``user_namespaces``, ``raw_sockets``:
        privileges its commands get beyond the default, when the operator allows them the
        caller's tenant (``PermissionDenied`` otherwise), e.g. a browser's own sandbox needs
        user namespaces.

        Raises ``InvalidArgument`` (bad image, labels, resources, rules), ``ResourceExhausted``
        (quota or full admission queue; see ``retry_after``), ``Unauthenticated``,
        ``SandboxNotFound`` or ``FailedPrecondition`` for a sandbox a rule names.
        """
        spec = env_pb2.SandboxSpec(
            image=image,
            labels=dict(labels or {}),
            resources=(resources or Resources()).to_proto(),
            env=dict(env or {}),
            working_dir=working_dir,
            owner_id=owner_id,
            network_policy=env_pb2.NetworkPolicy(
                egress=[rule.to_proto() for rule in egress], ingress_ports=ingress_ports
            ),
            privileges=env_pb2.SandboxPrivileges(
                raw_sockets=raw_sockets, user_namespaces=user_namespaces
            ),
        )
        if heartbeat_timeout is not None:
            spec.heartbeat_timeout.CopyFrom(duration(heartbeat_timeout))
        request = env_service_pb2.CreateSandboxRequest(
            spec=spec, request_id=request_id or uuid.uuid4().hex
        )
        return SandboxCreation(self._create(request, wait, wait_timeout, keep_alive))

    async def _create(
        self,
        request: env_service_pb2.CreateSandboxRequest,
        wait: bool,
        wait_timeout: float | None,
        keep_alive: bool,
    ) -> AsyncSandbox:
        response = await self._unary("CreateSandbox", request, retry=True, sandbox_call=False)
        sandbox = AsyncSandbox(self, SandboxInfo.from_proto(response.sandbox), keep_alive)
        if wait:
            try:
                await sandbox.wait(timeout=wait_timeout)
            except BaseException:
                # The caller never gets the handle, so nobody else would delete it.
                with contextlib.suppress(Exception):
                    await asyncio.shield(sandbox.delete())
                raise
        return sandbox

    async def get(self, sandbox_id: str, *, keep_alive: bool = False) -> AsyncSandbox:
        """A handle to an existing sandbox. ``keep_alive=True`` heartbeats it while open.

        Raises :class:`~orchard.sdk.errors.SandboxNotFound`.
        """
        info = await self.get_info(sandbox_id)
        return AsyncSandbox(self, info, keep_alive)

    async def get_info(self, sandbox_id: str) -> SandboxInfo:
        """The sandbox as the service describes it now. Raises ``SandboxNotFound``."""
        request = env_service_pb2.GetSandboxRequest(sandbox_id=sandbox_id)
        response = await self._unary("GetSandbox", request, retry=True)
        return SandboxInfo.from_proto(response.sandbox)

    async def list(
        self,
        label_selector: str | Mapping[str, str] = "",
        *,
        states: Sequence[SandboxState] = (),
        page_size: int = 100,
    ) -> AsyncIterator[SandboxInfo]:
        """Every sandbox of the caller's tenant that matches, fetched a page at a time.

        ``label_selector`` is ``"k=v,k2!=v2,present,!absent"`` or a dict of required values::

            async for info in client.list({"task": "demo"}, states=[SandboxState.READY]):
                print(info.id)
        """
        token = ""
        while True:
            page, token = await self.list_page(
                label_selector, states=states, page_size=page_size, page_token=token
            )
            for info in page:
                yield info
            if not token:
                return

    async def list_page(
        self,
        label_selector: str | Mapping[str, str] = "",
        *,
        states: Sequence[SandboxState] = (),
        page_size: int = 100,
        page_token: str = "",
    ) -> tuple[builtins.list[SandboxInfo], str]:
        """One page of :meth:`list` and the token of the next ("" after the last)."""
        if isinstance(label_selector, Mapping):
            label_selector = ",".join(f"{k}={v}" for k, v in label_selector.items())
        request = env_service_pb2.ListSandboxesRequest(
            label_selector=label_selector,
            states=[state.to_proto() for state in states],
            page_size=page_size,
            page_token=page_token,
        )
        response = await self._unary("ListSandboxes", request, retry=True, sandbox_call=False)
        return [SandboxInfo.from_proto(s) for s in response.sandboxes], response.next_page_token

    async def delete(self, sandbox_id: str) -> None:
        """Delete a sandbox; succeeds when it is already gone."""
        request = env_service_pb2.DeleteSandboxRequest(
            sandbox_id=sandbox_id, request_id=uuid.uuid4().hex
        )
        if self.routes is not None:
            self.routes.forget(sandbox_id)
        await self._unary("DeleteSandbox", request, retry=True)


class SandboxCreation:
    """What :meth:`AsyncSandboxClient.create` returns: await it, or ``async with`` it."""

    def __init__(self, creating: Awaitable[AsyncSandbox]) -> None:
        self._creating = creating
        self._sandbox: AsyncSandbox | None = None

    def __await__(self) -> Generator[Any, None, AsyncSandbox]:
        return self._creating.__await__()

    async def __aenter__(self) -> AsyncSandbox:
        self._sandbox = await self._creating
        return self._sandbox

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._sandbox is not None:
            await self._sandbox.__aexit__(exc_type, exc, traceback)


class AsyncSandbox:
    """A handle to one sandbox: exec, files, lifecycle.

    ``async with`` deletes the sandbox on exit; :meth:`close` only stops the background
    heartbeats and leaves it running (it is reaped after its heartbeat timeout).
    """

    def __init__(self, client: AsyncSandboxClient, info: SandboxInfo, keep_alive: bool) -> None:
        self.client = client
        self.info = info
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.heartbeat_error: errors.ServiceError | None = None
        """Why background heartbeats stopped (e.g. ``SandboxNotFound`` once reaped), or None."""
        client._sandboxes.add(self)
        if keep_alive:
            self._heartbeat_task = asyncio.get_running_loop().create_task(
                self._heartbeat_loop(), name=f"orchard-heartbeat-{info.id}"
            )

    @property
    def id(self) -> str:
        """The sandbox id, e.g. ``"sbx-8f3c2a1d9e7b"``."""
        return self.info.id

    @property
    def state(self) -> SandboxState:
        """The state as last seen (see :meth:`refresh`)."""
        return self.info.state

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.state.value}>"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.shield(self.delete())

    # -- lifecycle ---------------------------------------------------------------------------

    async def refresh(self) -> SandboxInfo:
        """Fetch the sandbox's current description into :attr:`info` and return it."""
        self.info = await self.client.get_info(self.id)
        return self.info

    async def wait(self, timeout: float | None = _DEFAULT_WAIT_TIMEOUT_S) -> SandboxInfo:  # noqa: ASYNC109
        """Wait until READY. Raises ``SandboxFailed`` on FAILED, ``DeadlineExceeded`` after
        ``timeout`` seconds (None: no limit)."""
        request = env_service_pb2.WaitSandboxRequest(sandbox_id=self.id)
        if timeout is not None:
            request.timeout.CopyFrom(duration(timeout))
        deadline = None if timeout is None else timeout + _EXEC_DEADLINE_MARGIN_S
        response = await self.client._unary("WaitSandbox", request, retry=True, deadline=deadline)
        self.info = SandboxInfo.from_proto(response.sandbox)
        if self.info.state is SandboxState.FAILED:
            raise errors.SandboxFailed(
                self.id, self.info.failure_reason or "UNKNOWN", self.info.failure_message
            )
        return self.info

    async def update_egress(self, egress: Sequence[EgressRule]) -> SandboxInfo:
        """Replace what the sandbox may reach (applied when this returns; its ingress ports
        stay). Raises ``SandboxNotFound`` (it, or a sandbox a rule names), ``InvalidArgument``,
        ``FailedPrecondition`` (not READY; a named sandbox not READY or not accepting)."""
        request = env_service_pb2.UpdateNetworkPolicyRequest(
            sandbox_id=self.id,
            network_policy=env_pb2.NetworkPolicy(egress=[rule.to_proto() for rule in egress]),
        )
        response = await self.client._unary("UpdateNetworkPolicy", request, retry=True)
        self.info = SandboxInfo.from_proto(response.sandbox)
        return self.info

    async def heartbeat(self) -> float:
        """Renew the lease now; returns the new expiry as a Unix time. Raises SandboxNotFound."""
        request = env_service_pb2.HeartbeatSandboxRequest(sandbox_id=self.id)
        response = await self.client._unary("HeartbeatSandbox", request, retry=True)
        return float(response.expire_time.ToNanoseconds()) / 1e9

    def heartbeat_interval(self) -> float:
        """A third of the heartbeat timeout (asked for, else implied by the expiry)."""
        timeout = self.info.heartbeat_timeout
        if timeout is None and self.info.expire_time and self.info.create_time:
            timeout = (self.info.expire_time - self.info.create_time).total_seconds()
        return max(0.2, (timeout or _DEFAULT_HEARTBEAT_TIMEOUT_S) / 3)

    async def _heartbeat_loop(self) -> None:
        interval = self.heartbeat_interval()
        while True:
            await asyncio.sleep(interval)
            try:
                await self.heartbeat()
            except errors.NotFound as exc:
                log.warning("sandbox %s is gone; heartbeats stop: %s", self.id, exc)
                self.heartbeat_error = exc
                return
            except errors.ServiceError as exc:
                # The next beat still has two thirds of the timeout to get through.
                log.warning("heartbeat of sandbox %s failed: %s", self.id, exc)
                self.heartbeat_error = exc

    async def close(self) -> None:
        """Stop background heartbeats; the sandbox keeps running until its lease expires."""
        self.client._sandboxes.discard(self)
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def delete(self) -> None:
        """Stop heartbeats and delete the sandbox (idempotent)."""
        await self.close()
        await self.client.delete(self.id)

    # -- exec --------------------------------------------------------------------------------

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,  # noqa: ASYNC109
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        clear_env: bool = False,
        output_limit: int | None = None,
        check: bool = False,
    ) -> ExecResult:
        """Run a command to completion.

        ``command`` is an argv list (run directly) or a string (run by ``/bin/sh -c``).
        ``timeout`` kills the command's process group after that many seconds (the result
        then says ``timed_out``); ``check=True`` raises ``CommandFailed`` unless it exits 0::

            result = await sandbox.exec(["python3", "-c", "print(1 + 1)"], timeout=10)
            result = await sandbox.exec("cd /src && make test", check=True)

        Not retried on UNAVAILABLE, since the command may already have run. Raises
        ``SandboxNotReady``, ``FileNotFound`` (executable or ``cwd`` missing),
        ``InvalidArgument``, ``Unavailable`` (the sandbox's agent did not answer).
        """
        request = env_service_pb2.ExecRequest(
            sandbox_id=self.id,
            command=_command(
                command,
                timeout=timeout,
                stdin=stdin,
                env=env,
                cwd=cwd,
                clear_env=clear_env,
                output_limit=output_limit,
            ),
        )
        deadline = None if timeout is None else timeout + _EXEC_DEADLINE_MARGIN_S
        reply = await self._exec_direct(request.command, deadline)
        if reply is None:
            reply = await self.client._unary("Exec", request, retry=False, deadline=deadline)
        result = ExecResult.from_proto(reply.result, command=_show(command))
        return result.check() if check else result

    async def _exec_direct(self, command: exec_pb2.Command, deadline: float | None) -> Any:
        """Exec on the agent's direct route; None: the route is not usable, use the service."""
        routes = self.client.routes
        route = None if routes is None else await routes.get(self.id)
        if routes is None or route is None:
            return None
        was_connected = route.ready()
        try:
            return await route.stub.Exec(
                inagent_service_pb2.ExecRequest(command=command),
                metadata=route.metadata,
                timeout=deadline,
            )
        except grpc.RpcError as exc:
            from orchard.core.errors import error_info  # noqa: PLC0415

            info = error_info(exc)
            if info is not None and info.reason in REFUSED_BEFORE_RUNNING:
                routes.mark_down(self.id)  # refused before running: the service runs it
                routes.fallbacks += 1
                return None
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                routes.mark_down(self.id)
                if not was_connected:
                    # No connection before the call, none after: the agent never had it (its
                    # socket is gone, say): the service says what became of the sandbox.
                    routes.fallbacks += 1
                    return None
            raise self.client._error(exc, "Exec", True) from None

    async def exec_stream(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,  # noqa: ASYNC109
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        clear_env: bool = False,
    ) -> AsyncIterator[ExecEvent]:
        """Run a command and yield its events as they happen: ``ExecStarted``, then
        ``ExecStdout``/``ExecStderr`` chunks, then ``ExecExit``::

            async for event in sandbox.exec_stream(["pytest", "-x"]):
                match event:
                    case ExecStdout(data=data): sys.stdout.buffer.write(data)
                    case ExecExit(exit_code=code): print("exit", code)

        Leaving the loop early cancels the call, which kills the command's process group.
        """
        request = env_service_pb2.ExecStreamRequest(
            sandbox_id=self.id,
            command=_command(
                command,
                timeout=timeout,
                stdin=stdin,
                env=env,
                cwd=cwd,
                clear_env=clear_env,
                output_limit=None,
            ),
        )
        call = self.client.stub.ExecStream(request, metadata=self.client._metadata)
        try:
            async for response in call:
                event = exec_event_from_proto(response.event)
                if event is not None:
                    yield event
        except grpc.RpcError as exc:
            raise self.client._error(exc, "ExecStream", True) from None
        finally:
            call.cancel()

    async def exec_streaming_result(
        self,
        command: str | Sequence[str],
        *,
        on_stdout: Callable[[bytes], object] | None = None,
        on_stderr: Callable[[bytes], object] | None = None,
        **options: Any,
    ) -> ExecExit:
        """Stream a command, handing each output chunk to a callback; return its exit."""
        async for event in self.exec_stream(command, **options):
            if event.kind == "stdout" and on_stdout is not None:
                on_stdout(event.data)
            elif event.kind == "stderr" and on_stderr is not None:
                on_stderr(event.data)
            elif event.kind == "exit":
                return event
        raise errors.UnknownError("the command's stream ended without an exit event")

    # -- files -------------------------------------------------------------------------------

    async def write_file(
        self,
        path: str,
        data: bytes | str,
        *,
        mode: int = 0o644,
        make_parents: bool = True,
        no_overwrite: bool = False,
    ) -> FileInfo:
        """Write ``data`` to ``path`` in the sandbox, atomically. Returns the new file's info.

        Raises ``FileNotFound`` (parent missing and ``make_parents=False``), ``AlreadyExists``
        (``no_overwrite=True``), ``PermissionDenied``, ``ResourceExhausted`` (disk full).
        """
        content = data.encode() if isinstance(data, str) else data

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(content), CHUNK_BYTES):
                yield content[start : start + CHUNK_BYTES]

        return await self._write_stream(path, chunks, mode, make_parents, no_overwrite)

    async def _write_stream(
        self,
        path: str,
        chunks: Callable[[], AsyncIterator[bytes]],
        mode: int,
        make_parents: bool,
        no_overwrite: bool,
    ) -> FileInfo:
        """One WriteFile call fed by ``chunks()``; retried (from the start) when safe."""
        header = env_service_pb2.WriteFileHeader(
            sandbox_id=self.id,
            path=path,
            mode=mode,
            make_parents=make_parents,
            no_overwrite=no_overwrite,
        )

        async def requests() -> AsyncIterator[env_service_pb2.WriteFileRequest]:
            yield env_service_pb2.WriteFileRequest(header=header)
            async for chunk in chunks():
                yield env_service_pb2.WriteFileRequest(data=chunk)

        async def attempt() -> FileInfo:
            response = await self.client.stub.WriteFile(requests(), metadata=self.client._metadata)
            return FileInfo.from_proto(response.info)

        # The write is atomic, so repeating it is safe, unless a first attempt that did land
        # would make `no_overwrite` fail the second.
        return await self.client._retrying("WriteFile", attempt, retry=not no_overwrite)

    async def read_file(self, path: str, *, offset: int = 0, limit: int = 0) -> bytes:
        """The content of ``path`` (from ``offset``, at most ``limit`` bytes; 0 = to the end).

        Raises ``FileNotFound``, ``FailedPrecondition`` (reason ``IS_A_DIRECTORY``),
        ``PermissionDenied``.
        """
        parts: list[bytes] = []
        async for chunk in self.read_file_chunks(path, offset=offset, limit=limit):
            parts.append(chunk)
        return b"".join(parts)

    async def read_file_chunks(
        self, path: str, *, offset: int = 0, limit: int = 0
    ) -> AsyncIterator[bytes]:
        """The content of ``path`` as it arrives; an interrupted stream resumes where it was
        (through the service, when it was on the direct route)."""
        received = 0
        attempt = 0
        routes = self.client.routes
        while True:
            route = None if routes is None else await routes.get(self.id)
            if route is not None:
                call = route.stub.ReadFile(
                    inagent_service_pb2.ReadFileRequest(
                        path=path,
                        offset=offset + received,
                        limit=max(limit - received, 0) if limit else 0,
                    ),
                    metadata=route.metadata,
                )
            else:
                request = env_service_pb2.ReadFileRequest(
                    sandbox_id=self.id,
                    path=path,
                    offset=offset + received,
                    limit=max(limit - received, 0) if limit else 0,
                )
                call = self.client.stub.ReadFile(request, metadata=self.client._metadata)
            try:
                async for response in call:
                    if response.data:
                        received += len(response.data)
                        yield response.data
                return
            except grpc.RpcError as exc:
                if routes is not None and route is not None and _route_failed(exc):
                    routes.mark_down(self.id)  # a read is safe to repeat: on through the service
                    continue
                if self.client.retry.should_retry(exc.code(), attempt):
                    await asyncio.sleep(self.client.retry.backoff(attempt))
                    attempt += 1
                    continue
                raise self.client._error(exc, "ReadFile", True) from None
            finally:
                call.cancel()

    async def stat(self, path: str, *, follow_symlinks: bool = False) -> FileInfo:
        """Describe ``path``. Raises ``FileNotFound``."""
        request = env_service_pb2.StatFileRequest(
            sandbox_id=self.id, path=path, follow_symlinks=follow_symlinks
        )
        response = await self.client._unary("StatFile", request, retry=True)
        return FileInfo.from_proto(response.info)

    async def exists(self, path: str) -> bool:
        """True when ``path`` exists (a dangling symlink counts)."""
        try:
            await self.stat(path)
        except errors.FileNotFound:
            return False
        return True

    async def list_files(self, path: str) -> list[FileInfo]:
        """Entries of a directory, sorted by name. Raises ``FileNotFound``,
        ``FailedPrecondition`` (reason ``NOT_A_DIRECTORY``)."""
        entries: list[FileInfo] = []
        token = ""
        while True:
            request = env_service_pb2.ListFilesRequest(
                sandbox_id=self.id, path=path, page_token=token
            )
            response = await self.client._unary("ListFiles", request, retry=True)
            entries.extend(FileInfo.from_proto(entry) for entry in response.entries)
            token = response.next_page_token
            if not token:
                return entries

    async def upload(
        self,
        local_path: str | os.PathLike[str],
        remote_path: str,
        *,
        progress: TransferProgress | None = None,
    ) -> int:
        """Copy a local file or directory tree to ``remote_path`` (which becomes the copy).

        Files keep their permission bits; missing parent directories are created; empty
        directories and symbolic links are recreated with ``mkdir -p`` and ``ln -s`` inside
        the sandbox. ``progress(done, total)`` is called as bytes go. Returns bytes written::

            await sandbox.upload("./repo", "/workspace/repo")
        """
        from orchard.sdk.transfer import plan_upload  # noqa: PLC0415

        plan = plan_upload(Path(local_path), remote_path)
        done = 0
        if progress is not None:
            progress(0, plan.total_bytes)
        if plan.directories:
            await self.exec(["mkdir", "-p", "--", *plan.directories], check=True)
        for item in plan.files:

            def reporter(count: int) -> None:
                nonlocal done
                done += count
                if progress is not None:
                    progress(done, plan.total_bytes)

            sent_before = done
            await self._write_stream(
                item.remote, _file_chunks(item.local, reporter), item.mode, True, False
            )
            # A retried write read the file again; count its bytes once.
            done = sent_before + item.size
        for link in plan.symlinks:
            await self.exec(["ln", "-sfn", "--", link.target, link.remote], check=True)
        return done

    async def download(
        self,
        remote_path: str,
        local_path: str | os.PathLike[str],
        *,
        progress: TransferProgress | None = None,
    ) -> int:
        """Copy a file or directory tree from the sandbox to ``local_path`` (which becomes
        the copy). Files keep their permission bits, symbolic links are recreated as links.
        Returns bytes read::

            await sandbox.download("/workspace/out", "./out")
        """
        from orchard.sdk.transfer import DownloadItem, confined, open_new_file  # noqa: PLC0415

        root = await self.stat(remote_path)
        items: list[DownloadItem] = await self._plan_download(root, Path(local_path))
        total = sum(item.info.size for item in items if item.info.type is FileType.REGULAR)
        done = 0
        if progress is not None:
            progress(0, total)
        # Everything below the destination the caller chose, whatever the sandbox listed:
        # each entry's parent must resolve inside it (a link made by an earlier entry is not
        # followed out), and files are created new (O_EXCL | O_NOFOLLOW).
        inside = ""
        for item in items:
            if inside:
                confined(item.local, inside, may_be_link=item.info.type is not FileType.DIRECTORY)
            if item.info.type is FileType.DIRECTORY:
                item.local.mkdir(parents=not inside, exist_ok=True)
            elif item.info.type is FileType.SYMLINK:
                item.local.parent.mkdir(parents=True, exist_ok=True)
                item.local.unlink(missing_ok=True)
                item.local.symlink_to(item.info.symlink_target)
            elif item.info.type is FileType.REGULAR:
                item.local.parent.mkdir(parents=True, exist_ok=True)
                temporary = item.local.with_name(f".{item.local.name}.orchard-partial")
                if inside:
                    confined(temporary, inside, may_be_link=True)
                try:
                    with os.fdopen(open_new_file(temporary), "wb") as out:
                        async for chunk in self.read_file_chunks(item.info.path):
                            out.write(chunk)
                            done += len(chunk)
                            if progress is not None:
                                progress(done, total)
                        os.fchmod(out.fileno(), item.info.mode or 0o644)
                    os.replace(temporary, item.local)
                except BaseException:
                    temporary.unlink(missing_ok=True)
                    raise
            else:
                log.warning("skipping %s: not a file, directory or link", item.info.path)
            if not inside:
                # The destination itself is the caller's: a link there is followed on purpose.
                inside = str(item.local.resolve())
        for item in reversed(items):
            is_dir = item.info.type is FileType.DIRECTORY
            if is_dir and item.info.mode and not item.local.is_symlink():
                os.chmod(item.local, item.info.mode)
        return done

    async def _plan_download(self, root: FileInfo, local: Path) -> list[Any]:
        """Every entry below ``root`` with where it lands, parents before their children."""
        from orchard.sdk.transfer import (  # noqa: PLC0415
            MAX_DOWNLOAD_DEPTH,
            DownloadItem,
            checked_entry_name,
        )

        items: list[DownloadItem] = []
        pending = [(root, local, 0)]
        while pending:
            info, target, depth = pending.pop()
            items.append(DownloadItem(info, target))
            if info.type is not FileType.DIRECTORY:
                continue
            if depth >= MAX_DOWNLOAD_DEPTH:
                raise errors.UnsafeListing(
                    f"{info.path} is more than {MAX_DOWNLOAD_DEPTH} directories deep; "
                    "download stopped"
                )
            seen: set[str] = set()
            children = [
                (entry, target / checked_entry_name(info.path, entry.name, seen), depth + 1)
                for entry in await self.list_files(info.path)
            ]
            pending.extend(reversed(children))
        return items

    async def apply_diff(
        self, diff: str | bytes, *, cwd: str | None = None, strip: int = 1
    ) -> ExecResult:
        """Apply a unified diff to the tree at ``cwd`` (default: the sandbox's working dir).

        Uses ``git apply`` when the sandbox has git (atomic: all hunks or none), else
        ``patch`` (checked with ``--dry-run`` first, so a failing diff changes nothing).
        ``strip`` is the ``-p`` level (1 for ``a/`` and ``b/`` prefixes)::

            await sandbox.apply_diff(model_output_diff, cwd="/workspace/repo")

        Raises :class:`~orchard.sdk.errors.PatchFailed` with the tool's output when the diff
        does not apply, or when the sandbox has neither tool.
        """
        content = diff.encode() if isinstance(diff, str) else diff
        if not content.strip():
            raise errors.PatchFailed("the diff is empty")
        patch_path = f"/tmp/orchard-{uuid.uuid4().hex[:12]}.diff"
        await self.write_file(patch_path, content, mode=0o600)
        try:
            return await self._apply_patch_file(patch_path, cwd, strip)
        finally:
            with contextlib.suppress(errors.OrchardSDKError):
                await self.exec(["rm", "-f", "--", patch_path], timeout=30)

    async def _apply_patch_file(self, patch_path: str, cwd: str | None, strip: int) -> ExecResult:
        attempts: list[tuple[str, list[list[str]]]] = [
            (
                "git apply",
                [["git", "apply", f"-p{strip}", "--whitespace=nowarn", "--", patch_path]],
            ),
            (
                "patch",
                [
                    ["patch", f"-p{strip}", "--batch", "--forward", "--dry-run", "-i", patch_path],
                    ["patch", f"-p{strip}", "--batch", "--forward", "-i", patch_path],
                ],
            ),
        ]
        for tool, commands in attempts:
            try:
                result: ExecResult | None = None
                for argv in commands:
                    result = await self.exec(argv, cwd=cwd, timeout=120)
                    if not result.ok:
                        output = (result.stdout_text + result.stderr_text).strip()
                        raise errors.PatchFailed(
                            f"the diff does not apply ({tool} exited with {result.exit_code})",
                            tool=tool,
                            output=output,
                        )
                assert result is not None
                return result
            except errors.FileNotFound as exc:
                if exc.reason == "WORKING_DIR_NOT_FOUND":
                    raise
                continue  # this tool is not installed; try the next
        raise errors.PatchFailed(
            "cannot apply the diff: the sandbox has neither `git` nor `patch` on its PATH; "
            "use an image with one of them"
        )


def _command(
    command: str | Sequence[str],
    *,
    timeout: float | None,
    stdin: bytes | str | None,
    env: Mapping[str, str] | None,
    cwd: str | None,
    clear_env: bool,
    output_limit: int | None,
) -> exec_pb2.Command:
    message = exec_pb2.Command(
        working_dir=cwd or "",
        env=dict(env or {}),
        clear_env=clear_env,
        stdin=stdin.encode() if isinstance(stdin, str) else (stdin or b""),
        output_limit_bytes=output_limit or 0,
    )
    if isinstance(command, str):
        message.shell = command
    else:
        if not command:
            raise ValueError("the command is empty")
        message.argv.extend(command)
    if timeout is not None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        message.timeout.CopyFrom(duration(timeout))
    return message


def _show(command: str | Sequence[str]) -> str:
    return command if isinstance(command, str) else shlex.join(command)


def _route_failed(exc: grpc.RpcError) -> bool:
    """The direct route failed, not the call: the agent refused the credential, or did not
    answer."""
    from orchard.core.errors import error_info  # noqa: PLC0415

    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return True
    info = error_info(exc)
    return info is not None and info.reason in REFUSED_BEFORE_RUNNING


def _has_error_info(exc: grpc.RpcError) -> bool:
    from orchard.core.errors import error_info  # noqa: PLC0415

    return error_info(exc) is not None


def _file_chunks(path: Path, reporter: Callable[[int], None]) -> Callable[[], AsyncIterator[bytes]]:
    """A factory of chunk streams over a local file (a retry reads it again)."""

    async def chunks() -> AsyncIterator[bytes]:
        with path.open("rb") as source:
            while True:
                chunk = await asyncio.to_thread(source.read, CHUNK_BYTES)
                if not chunk:
                    return
                reporter(len(chunk))
                yield chunk

    return chunks
