"""``orchard.env.v1.EnvService``: the gRPC methods. Lifecycle calls go to the
:class:`~orchard.env.controller.SandboxController`; exec and file calls go straight to the
sandbox's agent, one at a time per sandbox on this replica (see :class:`AgentLink`)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, NoReturn, TypeVar

import grpc

from orchard.core.errors import OrchardError, Reason
from orchard.env.agent_routes import open_route
from orchard.env.agents import AgentLink
from orchard.env.auth import TenantAuthenticator
from orchard.env.config import EnvConfig
from orchard.env.controller import SandboxController
from orchard.env.metrics import ExecObservation
from orchard.env.reasons import EnvReason
from orchard.env.records import SandboxRecord
from orchard.env.runtime.base import AgentUnreachable
from orchard.env.selectors import parse_selector
from orchard.env.v1 import env_pb2, env_service_pb2, env_service_pb2_grpc
from orchard.env.validation import (
    heartbeat_timeout_s,
    invalid,
    validate_egress,
    validate_labels,
    validate_spec,
)
from orchard.inagent.v1 import inagent_service_pb2 as agent_pb2

__all__ = ["EnvServicer"]

T = TypeVar("T")

_STATUS_DETAILS_KEY = "grpc-status-details-bin"
_DEFAULT_PAGE = 100
_MAX_PAGE = 1000
_MAX_FORKS = 64


_BROKEN_OFF = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
"""How a call to an agent ends when its link is closed under it."""


class EnvServicer(env_service_pb2_grpc.EnvServiceServicer):
    """The API. Built before the server starts; :meth:`attach` gives it its controller."""

    def __init__(self, config: EnvConfig) -> None:
        self._config = config
        self._auth = TenantAuthenticator(config.auth)
        self._controller: SandboxController | None = None

    def authenticate(self, context: grpc.aio.ServicerContext) -> str:
        """The call's tenant, or UNAUTHENTICATED; the server runs it first for a request that
        does not parse, so garbage without a valid token learns nothing more."""
        return self._auth.tenant(context)

    def attach(self, controller: SandboxController | None) -> None:
        self._controller = controller

    @property
    def controller(self) -> SandboxController:
        if self._controller is None:
            raise OrchardError(EnvReason.SERVICE_STARTING, "the environment service is starting")
        return self._controller

    def _sandbox(self, record: SandboxRecord) -> env_pb2.Sandbox:
        # Records keep spec.env sealed; the tenant that set the values reads them back.
        return self.controller.sealer.opened(record.sandbox)

    # -- lifecycle -------------------------------------------------------------------------

    async def CreateSandbox(
        self, request: env_service_pb2.CreateSandboxRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.CreateSandboxResponse:
        tenant = self._auth.tenant(context)
        spec = request.spec
        ttl = validate_spec(spec, self._config.limits)
        self.controller.images.check(tenant, spec.image)
        self.controller.check_privileges(tenant, spec, "spec.privileges")
        if spec.owner_id:
            _require_owner_id(spec.owner_id, "spec.owner_id")
        if len(request.request_id) > 256:
            raise invalid("request_id", "at most 256 characters")
        record = await self.controller.create(tenant, spec, ttl, request.request_id)
        return env_service_pb2.CreateSandboxResponse(sandbox=self._sandbox(record))

    async def WaitSandbox(
        self, request: env_service_pb2.WaitSandboxRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.WaitSandboxResponse:
        tenant = self._auth.tenant(context)
        _require_id(request.sandbox_id)
        timeout: float | None = None
        if request.HasField("timeout"):
            if request.timeout.seconds < 0 or request.timeout.nanos < 0:
                raise invalid("timeout", "must not be negative")
            timeout = request.timeout.ToNanoseconds() / 1e9
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = remaining if timeout is None else min(timeout, remaining)
        record = await self.controller.wait(tenant, request.sandbox_id, timeout)
        return env_service_pb2.WaitSandboxResponse(sandbox=self._sandbox(record))

    async def GetSandbox(
        self, request: env_service_pb2.GetSandboxRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.GetSandboxResponse:
        tenant = self._auth.tenant(context)
        _require_id(request.sandbox_id)
        record = await self.controller.get(tenant, request.sandbox_id)
        return env_service_pb2.GetSandboxResponse(sandbox=self._sandbox(record))

    async def ListSandboxes(
        self, request: env_service_pb2.ListSandboxesRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.ListSandboxesResponse:
        tenant = self._auth.tenant(context)
        if request.page_size < 0 or request.page_size > _MAX_PAGE:
            raise invalid("page_size", f"must be 0-{_MAX_PAGE}, got {request.page_size}")
        page_size = request.page_size or _DEFAULT_PAGE
        matches = parse_selector(request.label_selector)
        states = set(request.states)
        query = _query_digest(request.label_selector, sorted(states))
        after = _decode_token(request.page_token, query) if request.page_token else ""

        def keep(record: SandboxRecord) -> bool:
            return (not states or record.state in states) and matches(record.sandbox.spec.labels)

        records, more = await self.controller.list_records(tenant, after, page_size, keep)
        for record in records:
            await self.controller.fill_expire_time(record)
        token = _encode_token(records[-1].id, query) if more and records else ""
        return env_service_pb2.ListSandboxesResponse(
            sandboxes=[self._sandbox(r) for r in records], next_page_token=token
        )

    async def DeleteSandbox(
        self, request: env_service_pb2.DeleteSandboxRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.DeleteSandboxResponse:
        tenant = self._auth.tenant(context)
        _require_id(request.sandbox_id)
        await self.controller.delete(tenant, request.sandbox_id)
        return env_service_pb2.DeleteSandboxResponse()

    async def HeartbeatSandbox(
        self, request: env_service_pb2.HeartbeatSandboxRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.HeartbeatSandboxResponse:
        tenant = self._auth.tenant(context)
        _require_id(request.sandbox_id)
        expire = await self.controller.heartbeat(tenant, request.sandbox_id)
        response = env_service_pb2.HeartbeatSandboxResponse()
        response.expire_time.FromNanoseconds(int(expire * 1e9))
        return response

    # -- exec and files: straight to the agent ----------------------------------------------

    async def _link(self, context: grpc.aio.ServicerContext, sandbox_id: str) -> AgentLink:
        tenant = self._auth.tenant(context)
        _require_id(sandbox_id)
        return await self.controller.agent(tenant, sandbox_id)

    def _timeout(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        return self._config.agent_call_timeout_s if remaining is None else max(remaining, 0.001)

    @asynccontextmanager
    async def _agent_call(
        self, link: AgentLink, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        """Turn the agent's failures into ours: UNAVAILABLE with a clear message (and a check
        of whether the sandbox died); every other status and its ErrorInfo unchanged.

        A call whose link closed under it (the sandbox failed or is being deleted meanwhile)
        ends in FAILED_PRECONDITION: grpc.aio cancels such a call, and a cancellation leaving
        this handler would end the RPC with no status, so the caller would wait for its
        deadline. Only this handler's own cancellation (its caller went away) passes through.
        """
        try:
            yield
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
            await self._agent_failed(link, context, exc)

    async def _agent_failed(
        self,
        link: AgentLink,
        context: grpc.aio.ServicerContext,
        exc: asyncio.CancelledError | grpc.aio.AioRpcError,
    ) -> NoReturn:
        """Raise what a call to the agent that ended in ``exc`` ends in (see _agent_call)."""
        if isinstance(exc, asyncio.CancelledError):
            task = asyncio.current_task()
            if not link.closed or (task is not None and task.cancelling()):
                raise exc
        if link.closed and (isinstance(exc, asyncio.CancelledError) or exc.code() in _BROKEN_OFF):
            # gRPC cancels a closing channel's calls; the exec lane's connection breaks off.
            raise OrchardError(
                EnvReason.SANDBOX_NOT_READY,
                f"sandbox {link.sandbox_id!r} stopped being READY during the call "
                f"({link.closed}); what the call had done in it is unknown",
                metadata={"sandbox_id": link.sandbox_id},
            ) from None
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            tenant = self._auth.tenant(context)
            self.controller.check_alive(tenant, link.sandbox_id)
            raise OrchardError(
                EnvReason.AGENT_UNAVAILABLE,
                f"the agent of sandbox {link.sandbox_id!r} did not answer "
                f"({exc.details()}); the sandbox may have died",
                metadata={"sandbox_id": link.sandbox_id},
            ) from None
        trailing = tuple(
            (k, v) for k, v in (exc.trailing_metadata() or ()) if k == _STATUS_DETAILS_KEY
        )
        await context.abort(exc.code(), exc.details() or "", trailing_metadata=trailing)
        raise AssertionError("unreachable")  # abort raises

    async def _unary(
        self,
        context: grpc.aio.ServicerContext,
        sandbox_id: str,
        call: Callable[[Any, float], Awaitable[T]],
    ) -> T:
        """``call(stub, timeout)`` on the sandbox's agent, under its link's lock."""
        link = await self._link(context, sandbox_id)
        async with link.lock, self._agent_call(link, context):
            timeout = self._timeout(context)
            return await call(await link.grpc(timeout), timeout)
        raise AssertionError("unreachable")  # the context manager aborts or re-raises

    def _exec_metrics(self) -> ExecObservation:
        return self.controller.metrics.exec_observation()

    async def Exec(
        self, request: env_service_pb2.ExecRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.ExecResponse:
        # _unary and _agent_call written out: the hot path then makes no async generator,
        # lambda or extra coroutine per call.
        with self._exec_metrics():
            link = await self._link(context, request.sandbox_id)
            async with link.lock:
                try:
                    if link.lane is not None:
                        reply = await link.lane.exec(
                            agent_pb2.ExecRequest(command=request.command), self._timeout(context)
                        )
                    else:
                        timeout = self._timeout(context)
                        reply = await (await link.grpc(timeout)).Exec(
                            agent_pb2.ExecRequest(command=request.command), timeout=timeout
                        )
                except (asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
                    await self._agent_failed(link, context, exc)
            return env_service_pb2.ExecResponse(result=reply.result)

    async def ExecStream(
        self, request: env_service_pb2.ExecStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[env_service_pb2.ExecStreamResponse]:
        with self._exec_metrics():
            link = await self._link(context, request.sandbox_id)
            async with link.lock, self._agent_call(link, context):
                timeout = self._timeout(context)
                call = (await link.grpc(timeout)).ExecStream(
                    agent_pb2.ExecStreamRequest(command=request.command), timeout=timeout
                )
                try:
                    async for reply in call:
                        yield env_service_pb2.ExecStreamResponse(event=reply.event)
                finally:
                    # A cancelled or failed caller cancels the agent's call, which kills the
                    # command's process group.
                    call.cancel()

    async def WriteFile(
        self,
        request_iterator: AsyncIterator[env_service_pb2.WriteFileRequest],
        context: grpc.aio.ServicerContext,
    ) -> env_service_pb2.WriteFileResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("payload") != "header":
            raise invalid("header", "the first WriteFile message must carry the header")
        header = first.header
        if not header.path:
            raise invalid("header.path", "required")
        link = await self._link(context, header.sandbox_id)
        refused: list[OrchardError] = []

        async def forward() -> AsyncIterator[agent_pb2.WriteFileRequest]:
            yield agent_pb2.WriteFileRequest(
                header=agent_pb2.WriteFileHeader(
                    path=header.path,
                    mode=header.mode,
                    make_parents=header.make_parents,
                    no_overwrite=header.no_overwrite,
                )
            )
            async for message in request_iterator:
                if message.WhichOneof("payload") == "header":
                    # Raising here would only end the request stream, and the agent would
                    # wait for the rest until the deadline: cancel its call (no commit).
                    refused.append(
                        invalid("header", "only the first WriteFile message may carry a header")
                    )
                    call.cancel()
                    return
                yield agent_pb2.WriteFileRequest(data=message.data)

        async with link.lock, self._agent_call(link, context):
            timeout = self._timeout(context)
            call = (await link.grpc(timeout)).WriteFile(forward(), timeout=timeout)
            try:
                reply = await call
            except asyncio.CancelledError:
                if refused:
                    raise refused[0] from None
                raise
            finally:
                # A caller that gives up (or fails) ends the agent's call too, which closes
                # and removes the temporary file at once instead of at the deadline.
                call.cancel()
            return env_service_pb2.WriteFileResponse(info=reply.info, sha256=reply.sha256)
        raise AssertionError("unreachable")

    async def ReadFile(
        self, request: env_service_pb2.ReadFileRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[env_service_pb2.ReadFileResponse]:
        link = await self._link(context, request.sandbox_id)
        async with link.lock, self._agent_call(link, context):
            timeout = self._timeout(context)
            call = (await link.grpc(timeout)).ReadFile(
                agent_pb2.ReadFileRequest(
                    path=request.path, offset=request.offset, limit=request.limit
                ),
                timeout=timeout,
            )
            try:
                async for reply in call:
                    response = env_service_pb2.ReadFileResponse(data=reply.data)
                    if reply.HasField("info"):
                        response.info.CopyFrom(reply.info)
                    yield response
            finally:
                call.cancel()

    async def ListFiles(
        self, request: env_service_pb2.ListFilesRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.ListFilesResponse:
        reply = await self._unary(
            context,
            request.sandbox_id,
            lambda stub, timeout: stub.ListFiles(
                agent_pb2.ListFilesRequest(
                    path=request.path, page_size=request.page_size, page_token=request.page_token
                ),
                timeout=timeout,
            ),
        )
        return env_service_pb2.ListFilesResponse(
            entries=reply.entries, next_page_token=reply.next_page_token
        )

    async def StatFile(
        self, request: env_service_pb2.StatFileRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.StatFileResponse:
        reply = await self._unary(
            context,
            request.sandbox_id,
            lambda stub, timeout: stub.StatFile(
                agent_pb2.StatFileRequest(
                    path=request.path, follow_symlinks=request.follow_symlinks
                ),
                timeout=timeout,
            ),
        )
        return env_service_pb2.StatFileResponse(info=reply.info)

    # -- not in this version ---------------------------------------------------------------

    async def _unimplemented(self, context: grpc.aio.ServicerContext, what: str) -> Any:
        self._auth.tenant(context)
        raise OrchardError(
            Reason.UNIMPLEMENTED, f"{what} is not implemented by this service version yet"
        )

    async def ForkSandbox(
        self, request: env_service_pb2.ForkSandboxRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.ForkSandboxResponse:
        tenant = self._auth.tenant(context)
        _require_id(request.sandbox_id)
        if not 1 <= request.count <= _MAX_FORKS:
            raise invalid("count", f"must be 1-{_MAX_FORKS}, got {request.count}")
        validate_labels(request.labels, "labels")
        if len(request.request_id) > 256:
            raise invalid("request_id", "at most 256 characters")
        records = await self.controller.fork(
            tenant, request.sandbox_id, request.count, dict(request.labels), request.request_id
        )
        return env_service_pb2.ForkSandboxResponse(sandboxes=[self._sandbox(r) for r in records])

    # -- owners ------------------------------------------------------------------------------

    async def CreateOwner(
        self, request: env_service_pb2.CreateOwnerRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.CreateOwnerResponse:
        tenant = self._auth.tenant(context)
        validate_labels(request.labels, "labels")
        if len(request.request_id) > 256:
            raise invalid("request_id", "at most 256 characters")
        # The same bounds as a sandbox's heartbeat timeout.
        probe = env_pb2.SandboxSpec()
        if request.HasField("heartbeat_timeout"):
            probe.heartbeat_timeout.CopyFrom(request.heartbeat_timeout)
        try:
            ttl = heartbeat_timeout_s(probe, self._config.limits)
        except OrchardError as exc:
            raise invalid("heartbeat_timeout", exc.message.partition(": ")[2]) from None
        record = await self.controller.create_owner(
            tenant, dict(request.labels), ttl, request.request_id
        )
        return env_service_pb2.CreateOwnerResponse(owner=record.owner)

    async def HeartbeatOwner(
        self, request: env_service_pb2.HeartbeatOwnerRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.HeartbeatOwnerResponse:
        tenant = self._auth.tenant(context)
        _require_owner_id(request.owner_id)
        expire = await self.controller.heartbeat_owner(tenant, request.owner_id)
        response = env_service_pb2.HeartbeatOwnerResponse()
        response.expire_time.FromNanoseconds(int(expire * 1e9))
        return response

    async def DeleteOwner(
        self, request: env_service_pb2.DeleteOwnerRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.DeleteOwnerResponse:
        tenant = self._auth.tenant(context)
        _require_owner_id(request.owner_id)
        deleted = await self.controller.delete_owner(tenant, request.owner_id)
        return env_service_pb2.DeleteOwnerResponse(sandboxes_deleted=deleted)

    async def UpdateNetworkPolicy(
        self,
        request: env_service_pb2.UpdateNetworkPolicyRequest,
        context: grpc.aio.ServicerContext,
    ) -> env_service_pb2.UpdateNetworkPolicyResponse:
        tenant = self._auth.tenant(context)
        _require_id(request.sandbox_id)
        validate_egress(request.network_policy, "network_policy")
        if len(request.request_id) > 256:
            raise invalid("request_id", "at most 256 characters")
        # Replacing the whole policy is idempotent: a retry needs no deduplication.
        record = await self.controller.update_network_policy(
            tenant, request.sandbox_id, request.network_policy
        )
        response = env_service_pb2.UpdateNetworkPolicyResponse(sandbox=self._sandbox(record))
        rules = request.network_policy.egress
        expiring = [rule.expire_time for rule in rules if rule.HasField("expire_time")]
        if expiring:
            response.next_expire_time.CopyFrom(min(expiring, key=lambda t: t.ToNanoseconds()))
        return response

    # -- the direct route ----------------------------------------------------------------------

    async def OpenAgentRoute(
        self, request: env_service_pb2.OpenAgentRouteRequest, context: grpc.aio.ServicerContext
    ) -> env_service_pb2.OpenAgentRouteResponse:
        tenant = self._auth.tenant(context)
        _require_id(request.sandbox_id)
        settings = self._config.agent_route
        if not settings.enabled:
            raise OrchardError(
                Reason.UNIMPLEMENTED,
                "this service issues no agent routes (agent_route.enabled is false); "
                "call Exec and the file calls here",
            )
        # The same checks as Exec: the tenant's own sandbox, READY, its agent verified.
        link = await self.controller.agent(tenant, request.sandbox_id)
        try:
            key = await self.controller.runtime.agent_key(request.sandbox_id)
        except AgentUnreachable as exc:
            raise OrchardError(
                EnvReason.AGENT_UNAVAILABLE,
                f"sandbox {request.sandbox_id!r}: cannot read its agent key now ({exc}); retry",
                metadata={"sandbox_id": request.sandbox_id},
            ) from None
        if key is None:
            raise OrchardError(
                Reason.UNIMPLEMENTED,
                f"sandbox {request.sandbox_id!r}: its agent holds no key (runtime "
                f"{self.controller.runtime.name!r}), so it has no direct route; call Exec and "
                "the file calls here",
            )
        # The route is gRPC: an agent started with its lane alone starts its server now.
        async with link.lock, self._agent_call(link, context):
            await link.grpc(self._timeout(context))
        route = open_route(key, request.sandbox_id, tenant, link.address, settings.credential_ttl_s)
        response = env_service_pb2.OpenAgentRouteResponse(
            address=route.address, credential=route.credential
        )
        response.expire_time.FromSeconds(route.expire_unix_s)
        return response


def _require_owner_id(owner_id: str, field: str = "owner_id") -> None:
    if not owner_id:
        raise invalid(field, "required")
    if len(owner_id) > 64 or "/" in owner_id:
        raise invalid(field, f"{owner_id[:64]!r} is not an owner id")


def _require_id(sandbox_id: str) -> None:
    if not sandbox_id:
        raise invalid("sandbox_id", "required")
    if len(sandbox_id) > 64 or "/" in sandbox_id:
        raise invalid("sandbox_id", f"{sandbox_id[:64]!r} is not a sandbox id")


def _query_digest(selector: str, states: list[int]) -> str:
    return hashlib.sha256(json.dumps([selector, states]).encode()).hexdigest()[:16]


def _encode_token(after: str, query: str) -> str:
    raw = json.dumps({"after": after, "query": query}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_token(token: str, query: str) -> str:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
        after, token_query = data["after"], data["query"]
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise invalid("page_token", "not a token this service issued") from None
    if not isinstance(after, str) or "/" in after:
        raise invalid("page_token", "not a token this service issued")
    if token_query != query:
        raise invalid("page_token", "issued for a different label_selector or states")
    return after
