"""Fixtures: a real ``orchard-inagent`` process, and a fault-injecting EnvService test double.

:class:`FaultInjectingEnvService` is a TEST DOUBLE, not the environment service. It exists to
inject UNAVAILABLE and other faults (with or without ``ErrorInfo``, with retry hints, in the
middle of a stream) that the real service does not produce on demand, and to record what the
client sent (request ids on retries, page tokens). It keeps sandbox records in memory and
forwards exec and file calls to a real ``orchard-inagent`` running on this machine, so those
calls exercise real processes and files. Tests of the real ``orchard-env`` live in
``test_real_service.py``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from orchard.env.v1 import env_pb2, env_service_pb2, env_service_pb2_grpc
from orchard.inagent.v1 import inagent_service_pb2 as agent_pb2
from orchard.inagent.v1 import inagent_service_pb2_grpc as agent_grpc

TOKEN = "test-token"
START_TIMEOUT_S = 15.0
_STATUS_DETAILS_KEY = "grpc-status-details-bin"


@dataclass
class Fault:
    """One injected failure: abort the next call of a method with this status."""

    code: grpc.StatusCode
    message: str = "injected fault"
    reason: str | None = None
    """ErrorInfo reason; None sends a bare status, as a broken transport would."""
    metadata: dict[str, str] = field(default_factory=dict)
    retry_delay_s: float | None = None
    """Attach a google.rpc.RetryInfo with this delay."""
    after_messages: int = 0
    """For server streams: send this many messages first, then fail."""

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        if self.reason is None and self.retry_delay_s is None:
            await context.abort(self.code, self.message)
        details = []
        if self.reason is not None:
            info = any_pb2.Any()
            info.Pack(
                error_details_pb2.ErrorInfo(
                    reason=self.reason, domain="orchard", metadata=self.metadata
                )
            )
            details.append(info)
        if self.retry_delay_s is not None:
            hint = any_pb2.Any()
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(self.retry_delay_s * 1e9))
            hint.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
            details.append(hint)
        status = status_pb2.Status(code=self.code.value[0], message=self.message, details=details)
        await context.abort_with_status(rpc_status.to_status(status))


class FaultInjectingEnvService(env_service_pb2_grpc.EnvServiceServicer):  # type: ignore[misc]
    """TEST DOUBLE of ``orchard.env.v1.EnvService`` for fault injection (see module docstring).

    ``inject(method, fault, times)`` makes the next ``times`` calls of ``method`` fail;
    ``calls`` records ``(method, request)`` for every call that arrived, faulted or not.
    """

    def __init__(self, agent_target: str | None) -> None:
        self.agent_target = agent_target
        self.faults: dict[str, collections.deque[Fault]] = collections.defaultdict(
            collections.deque
        )
        self.calls: list[tuple[str, Any]] = []
        self.sandboxes: dict[str, env_pb2.Sandbox] = {}
        self.by_request_id: dict[str, str] = {}
        self.heartbeats: collections.Counter[str] = collections.Counter()
        self._ids = itertools.count(1)
        self._agent: Any = None

    # -- control ----------------------------------------------------------------------------

    def inject(self, method: str, fault: Fault, times: int = 1) -> None:
        self.faults[method].extend([fault] * times)

    def methods(self) -> list[str]:
        return [name for name, _ in self.calls]

    def requests(self, method: str) -> list[Any]:
        return [request for name, request in self.calls if name == method]

    def reset(self) -> None:
        self.faults.clear()
        self.calls.clear()
        self.sandboxes.clear()
        self.by_request_id.clear()
        self.heartbeats.clear()

    # -- helpers ----------------------------------------------------------------------------

    async def _enter(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        self.calls.append((method, request))
        auth = dict(context.invocation_metadata() or ()).get("authorization", "")
        if auth != f"Bearer {TOKEN}":
            await Fault(
                grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token", "UNAUTHENTICATED"
            ).abort(context)
        queue = self.faults.get(method)
        if queue and queue[0].after_messages == 0:
            await queue.popleft().abort(context)

    async def _sandbox(
        self, sandbox_id: str, context: grpc.aio.ServicerContext, ready: bool = False
    ) -> env_pb2.Sandbox:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            await Fault(
                grpc.StatusCode.NOT_FOUND,
                f"no sandbox {sandbox_id!r}",
                "SANDBOX_NOT_FOUND",
                {"sandbox_id": sandbox_id},
            ).abort(context)
            raise AssertionError("unreachable")
        if ready and sandbox.state != env_pb2.SANDBOX_STATE_READY:
            await Fault(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"sandbox {sandbox_id!r} is not READY",
                "SANDBOX_NOT_READY",
                {"sandbox_id": sandbox_id},
            ).abort(context)
        return sandbox

    @property
    def agent(self) -> Any:
        if self._agent is None:
            if self.agent_target is None:
                raise RuntimeError("this double has no agent")
            channel = grpc.aio.insecure_channel(self.agent_target)
            self._agent = agent_grpc.AgentServiceStub(channel)
        return self._agent

    async def _pass_through(self, exc: grpc.aio.AioRpcError, context: Any) -> None:
        trailing = tuple(
            (k, v) for k, v in (exc.trailing_metadata() or ()) if k == _STATUS_DETAILS_KEY
        )
        await context.abort(exc.code(), exc.details() or "", trailing_metadata=trailing)

    # -- lifecycle ---------------------------------------------------------------------------

    async def CreateSandbox(self, request: Any, context: Any) -> Any:
        await self._enter("CreateSandbox", request, context)
        if request.request_id in self.by_request_id:
            existing = self.sandboxes[self.by_request_id[request.request_id]]
            return env_service_pb2.CreateSandboxResponse(sandbox=existing)
        sandbox_id = f"sbx-{next(self._ids):012x}"
        sandbox = env_pb2.Sandbox(
            id=sandbox_id,
            tenant="test",
            spec=request.spec,
            state=env_pb2.SANDBOX_STATE_PENDING,
            runtime="double",
        )
        sandbox.create_time.GetCurrentTime()
        self.sandboxes[sandbox_id] = sandbox
        if request.request_id:
            self.by_request_id[request.request_id] = sandbox_id
        return env_service_pb2.CreateSandboxResponse(sandbox=sandbox)

    async def WaitSandbox(self, request: Any, context: Any) -> Any:
        await self._enter("WaitSandbox", request, context)
        sandbox = await self._sandbox(request.sandbox_id, context)
        if sandbox.state == env_pb2.SANDBOX_STATE_PENDING:
            if sandbox.spec.image.startswith("fail:"):
                sandbox.state = env_pb2.SANDBOX_STATE_FAILED
                sandbox.failure.reason = "IMAGE_NOT_FOUND"
                sandbox.failure.message = f"no image {sandbox.spec.image!r}"
            elif sandbox.spec.image.startswith("slow:"):
                await Fault(grpc.StatusCode.DEADLINE_EXCEEDED, "not ready in time").abort(context)
            else:
                sandbox.state = env_pb2.SANDBOX_STATE_READY
                sandbox.ready_time.GetCurrentTime()
        return env_service_pb2.WaitSandboxResponse(sandbox=sandbox)

    async def GetSandbox(self, request: Any, context: Any) -> Any:
        await self._enter("GetSandbox", request, context)
        sandbox = await self._sandbox(request.sandbox_id, context)
        return env_service_pb2.GetSandboxResponse(sandbox=sandbox)

    async def ListSandboxes(self, request: Any, context: Any) -> Any:
        await self._enter("ListSandboxes", request, context)
        wanted = dict(
            term.split("=", 1) for term in request.label_selector.split(",") if "=" in term
        )
        matching = [
            s
            for sid, s in sorted(self.sandboxes.items())
            if sid > request.page_token
            and all(s.spec.labels.get(k) == v for k, v in wanted.items())
            and (not request.states or s.state in request.states)
        ]
        size = request.page_size or 100
        page = matching[:size]
        token = page[-1].id if len(matching) > size else ""
        return env_service_pb2.ListSandboxesResponse(sandboxes=page, next_page_token=token)

    async def DeleteSandbox(self, request: Any, context: Any) -> Any:
        await self._enter("DeleteSandbox", request, context)
        self.sandboxes.pop(request.sandbox_id, None)
        return env_service_pb2.DeleteSandboxResponse()

    async def HeartbeatSandbox(self, request: Any, context: Any) -> Any:
        await self._enter("HeartbeatSandbox", request, context)
        await self._sandbox(request.sandbox_id, context)
        self.heartbeats[request.sandbox_id] += 1
        response = env_service_pb2.HeartbeatSandboxResponse()
        response.expire_time.GetCurrentTime()
        return response

    # -- exec and files, forwarded to the real agent -----------------------------------------

    async def Exec(self, request: Any, context: Any) -> Any:
        await self._enter("Exec", request, context)
        await self._sandbox(request.sandbox_id, context, ready=True)
        try:
            reply = await self.agent.Exec(agent_pb2.ExecRequest(command=request.command))
        except grpc.aio.AioRpcError as exc:
            await self._pass_through(exc, context)
        return env_service_pb2.ExecResponse(result=reply.result)

    async def ExecStream(self, request: Any, context: Any) -> AsyncIterator[Any]:
        await self._enter("ExecStream", request, context)
        await self._sandbox(request.sandbox_id, context, ready=True)
        call = self.agent.ExecStream(agent_pb2.ExecStreamRequest(command=request.command))
        try:
            async for reply in call:
                yield env_service_pb2.ExecStreamResponse(event=reply.event)
        except grpc.aio.AioRpcError as exc:
            await self._pass_through(exc, context)
        finally:
            call.cancel()

    async def WriteFile(self, request_iterator: Any, context: Any) -> Any:
        first = await anext(aiter(request_iterator))
        await self._enter("WriteFile", first, context)
        await self._sandbox(first.header.sandbox_id, context, ready=True)
        header = first.header

        async def forward() -> AsyncIterator[Any]:
            yield agent_pb2.WriteFileRequest(
                header=agent_pb2.WriteFileHeader(
                    path=header.path,
                    mode=header.mode,
                    make_parents=header.make_parents,
                    no_overwrite=header.no_overwrite,
                )
            )
            async for message in request_iterator:
                yield agent_pb2.WriteFileRequest(data=message.data)

        try:
            reply = await self.agent.WriteFile(forward())
        except grpc.aio.AioRpcError as exc:
            await self._pass_through(exc, context)
        return env_service_pb2.WriteFileResponse(info=reply.info, sha256=reply.sha256)

    async def ReadFile(self, request: Any, context: Any) -> AsyncIterator[Any]:
        await self._enter("ReadFile", request, context)
        await self._sandbox(request.sandbox_id, context, ready=True)
        queue = self.faults.get("ReadFile")
        fault = queue.popleft() if queue and queue[0].after_messages else None
        call = self.agent.ReadFile(
            agent_pb2.ReadFileRequest(
                path=request.path, offset=request.offset, limit=request.limit, chunk_size=4096
            )
        )
        sent = 0
        try:
            async for reply in call:
                if fault is not None and sent == fault.after_messages:
                    await fault.abort(context)
                response = env_service_pb2.ReadFileResponse(data=reply.data)
                if reply.HasField("info"):
                    response.info.CopyFrom(reply.info)
                sent += 1
                yield response
        except grpc.aio.AioRpcError as exc:
            await self._pass_through(exc, context)
        finally:
            call.cancel()

    async def ListFiles(self, request: Any, context: Any) -> Any:
        await self._enter("ListFiles", request, context)
        await self._sandbox(request.sandbox_id, context, ready=True)
        try:
            reply = await self.agent.ListFiles(
                agent_pb2.ListFilesRequest(
                    path=request.path,
                    page_size=request.page_size or 3,
                    page_token=request.page_token,
                )
            )
        except grpc.aio.AioRpcError as exc:
            await self._pass_through(exc, context)
        return env_service_pb2.ListFilesResponse(
            entries=reply.entries, next_page_token=reply.next_page_token
        )

    async def StatFile(self, request: Any, context: Any) -> Any:
        await self._enter("StatFile", request, context)
        await self._sandbox(request.sandbox_id, context, ready=True)
        try:
            reply = await self.agent.StatFile(
                agent_pb2.StatFileRequest(
                    path=request.path, follow_symlinks=request.follow_symlinks
                )
            )
        except grpc.aio.AioRpcError as exc:
            await self._pass_through(exc, context)
        return env_service_pb2.StatFileResponse(info=reply.info)


class DoubleServer:
    """Serves a :class:`FaultInjectingEnvService` on its own loop thread, on a free port, so
    that sync and async tests alike can call it."""

    token = TOKEN

    def __init__(self, agent_target: str | None) -> None:
        self.servicer = FaultInjectingEnvService(agent_target)
        self.address = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None

    def fail(
        self,
        method: str,
        code: grpc.StatusCode,
        message: str = "injected fault",
        *,
        times: int = 1,
        **fault: Any,
    ) -> None:
        """Make the next ``times`` calls of ``method`` fail (see :class:`Fault`)."""
        self.servicer.inject(method, Fault(code, message, **fault), times)

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        env_service_pb2_grpc.add_EnvServiceServicer_to_server(self.servicer, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def _agent_command() -> list[str]:
    script = Path(sys.executable).parent / "orchard-inagent"
    return [str(script)] if script.exists() else [sys.executable, "-m", "orchard.inagent.main"]


@pytest.fixture(scope="session")
def agent_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``orchard-inagent`` for the session; yields its gRPC target."""
    directory = tmp_path_factory.mktemp("agent")
    address_file = directory / "agent.addr"
    log_path = directory / "agent.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                *_agent_command(),
                "--listen",
                f"unix:{directory / 'agent.sock'}",
                "--address-file",
                str(address_file),
                "--working-dir",
                str(directory),
                "--grace-period-s",
                "1",
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not address_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent did not start:\n{log_path.read_text()}")
            time.sleep(0.01)
        yield address_file.read_text().split()[0]
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def double_server(agent_target: str) -> Iterator[DoubleServer]:
    server = DoubleServer(agent_target)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def double(double_server: DoubleServer) -> Iterator[DoubleServer]:
    """The test double with no sandboxes, faults or recorded calls."""
    double_server.servicer.reset()
    yield double_server
    double_server.servicer.reset()


@pytest.fixture
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No ORCHARD_* variables from the caller, and a private state dir (the profile's home)."""
    for name in list(os.environ):
        if (name.startswith("ORCHARD_") and name != "ORCHARD_ETCD_BINARY") or (
            name == "XDG_STATE_HOME"
        ):
            monkeypatch.delenv(name)
    state = tmp_path / "state"
    monkeypatch.setenv("ORCHARD_STATE_DIR", str(state))
    return state
