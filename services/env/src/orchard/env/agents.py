"""Connections to sandbox agents: one cached grpc.aio channel and one lock per sandbox.

A channel is made only after the runtime confirmed that what serves at the record's address
is the agent it started (:meth:`Runtime.verify_agent`); this replica checks once per sandbox,
so a restarted service checks again before its first call.

Exec goes over the agent's exec lane when the record names one
(:mod:`orchard.env.exec_lane`: the same messages in a lean framing, a fraction of gRPC's CPU
per call); every other call, and Exec to an agent without a lane, over gRPC. An agent with a
lane may have started without its gRPC server (orchard-env asks runtimes for that:
``RuntimeSandboxSpec.agent_grpc_on_demand``): before the link's first gRPC call the agent is
asked over the lane to start it, and only then is what serves at its gRPC address verified.

Every call on a link carries orchard-env's own route credential for the sandbox
(:func:`orchard.env.agent_routes.service_credential`, signed with the key the runtime gave the
agent) when the runtime has a key: agents that require a credential (on Kubernetes) serve it.
The credential is minted when the link is made and again shortly before it expires, so a call
costs a clock read, not an HMAC.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from orchard.core.errors import OrchardError
from orchard.env.agent_routes import service_credential
from orchard.env.exec_lane import LaneClient
from orchard.env.reasons import EnvReason
from orchard.env.runtime.base import AgentUnreachable
from orchard.inagent.v1 import inagent_service_pb2, inagent_service_pb2_grpc

__all__ = ["AgentLink", "AgentLinks"]

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # Agents are local or one hop away; reconnect fast after a blip instead of backing off.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
CREDENTIAL_TTL_S = 3600
"""How long orchard-env's own credential for an agent is valid."""
CREDENTIAL_RENEW_S = 600
"""Minted again this long before it expires (room for clock skew between nodes)."""
_AGENT_METHODS = tuple(
    inagent_service_pb2.DESCRIPTOR.services_by_name["AgentService"].methods_by_name
)


class ServiceCredential:
    """orchard-env's credential for one sandbox's agent, as call metadata, renewed before it
    expires."""

    def __init__(
        self, agent_key: bytes, sandbox_id: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._key = agent_key
        self._sandbox_id = sandbox_id
        self._clock = clock
        self._renew_at = 0.0
        self._metadata = grpc.aio.Metadata()
        self._authorization = ""

    def metadata(self) -> grpc.aio.Metadata:
        # Built once per renewal as grpc's own Metadata: a tuple would be converted on every
        # call. grpc reads it and never changes it (no compression is set on these calls).
        if self._clock() >= self._renew_at:
            self._renew()
        return self._metadata

    def authorization(self) -> str:
        """The ``authorization`` value (``Bearer <credential>``), for the exec lane."""
        if self._clock() >= self._renew_at:
            self._renew()
        return self._authorization

    def _renew(self) -> None:
        expire = int(self._clock()) + CREDENTIAL_TTL_S
        credential = service_credential(self._key, self._sandbox_id, expire)
        self._authorization = f"Bearer {credential}"
        self._metadata = grpc.aio.Metadata(("authorization", self._authorization))
        self._renew_at = expire - CREDENTIAL_RENEW_S


def _with_credential(method: Any, credential: ServiceCredential) -> Any:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        return method(*args, metadata=credential.metadata(), **kwargs)

    return call


def _credentialed_stub(channel: grpc.aio.Channel, credential: ServiceCredential) -> Any:
    """An AgentService stub whose every call carries orchard-env's credential."""
    stub = inagent_service_pb2_grpc.AgentServiceStub(channel)
    for name in _AGENT_METHODS:
        setattr(stub, name, _with_credential(getattr(stub, name), credential))
    return stub


class AgentLink:
    """The way to one sandbox's agent.

    ``lock`` serializes this replica's calls to the sandbox: a call holds it from start to
    end, and a streaming call (ExecStream, ReadFile, WriteFile) for as long as it streams.
    ``closed`` says why the link was closed, once it is: grpc.aio ends the calls in flight on
    a closing channel by cancelling them, and their callers must not take that for their own
    cancellation. ``lane`` is the agent's exec lane, when it has one and this replica uses it:
    Exec goes there, every other call to the gRPC channel, which is made on the first such call
    (a sandbox that only runs commands never costs either end a channel, nor the agent a gRPC
    server).
    """

    def __init__(
        self,
        sandbox_id: str,
        address: str,
        lock: asyncio.Lock,
        *,
        credential: ServiceCredential | None = None,
        lane: LaneClient | None = None,
        verify_grpc: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.address = address
        self.lock = lock
        self.lane = lane
        self.closed = ""
        self._credential = credential
        self._verify_grpc = verify_grpc
        self._channel: grpc.aio.Channel | None = None
        self._stub: inagent_service_pb2_grpc.AgentServiceStub | None = None

    async def grpc(self, deadline_s: float) -> inagent_service_pb2_grpc.AgentServiceStub:
        """The AgentService stub (with orchard-env's credential on every call, when it has
        one), made with its channel on first use: over a lane, the agent is first asked to
        start its gRPC server, then what serves at its address is verified. Raises
        ``grpc.aio.AioRpcError`` as a call would, or PERMISSION_DENIED (``AGENT_NOT_VERIFIED``)."""
        if self._stub is None:
            if self.lane is not None:
                await self.lane.open_grpc(deadline_s)
            if self._verify_grpc is not None:
                await self._verify_grpc()
                self._verify_grpc = None
            channel = grpc.aio.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
            self._channel = channel
            self._stub = (
                inagent_service_pb2_grpc.AgentServiceStub(channel)
                if self._credential is None
                else _credentialed_stub(channel, self._credential)
            )
        return self._stub

    async def close(self) -> None:
        """Close the lane's connection and the channel, if made; calls in flight on them fail."""
        if self.lane is not None:
            self.lane.close()
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()


class AgentLinks:
    """Links (lanes, channels, locks) by sandbox id, made on first use, closed when the sandbox
    goes."""

    def __init__(
        self,
        verify: Callable[[str, str], Awaitable[bool]] | None = None,
        key: Callable[[str], Awaitable[bytes | None]] | None = None,
        *,
        use_lanes: bool = True,
    ) -> None:
        self._links: dict[str, AgentLink] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._verify = verify
        self._key = key
        self._use_lanes = use_lanes

    async def get(self, sandbox_id: str, address: str, lane_address: str = "") -> AgentLink:
        """The sandbox's link; PERMISSION_DENIED (``AGENT_NOT_VERIFIED``) when what serves at
        ``address`` (or at ``lane_address``, the agent's exec lane) is not the sandbox's
        agent."""
        link = self._links.get(sandbox_id)
        if link is not None and link.address == address:
            return link
        lane_address = lane_address if self._use_lanes else ""
        # Over a lane, its gRPC address is verified once the agent serves there (AgentLink.grpc).
        await self._check(sandbox_id, lane_address or address)
        link = self._links.get(sandbox_id)  # another call may have made it meanwhile
        if link is not None and link.address == address:
            return link
        agent_key = None if self._key is None else await _agent_key(self._key, sandbox_id)
        link = self._links.get(sandbox_id)
        if link is not None and link.address == address:
            return link
        if link is not None:
            self._close_later(link, "its agent's address changed")
        credential = None if agent_key is None else ServiceCredential(agent_key, sandbox_id)
        lane = None
        if lane_address:
            lane = LaneClient(
                lane_address, None if credential is None else credential.authorization
            )
        link = AgentLink(
            sandbox_id,
            address,
            link.lock if link is not None else asyncio.Lock(),
            credential=credential,
            lane=lane,
            verify_grpc=functools.partial(self._check, sandbox_id, address) if lane else None,
        )
        self._links[sandbox_id] = link
        return link

    async def _check(self, sandbox_id: str, address: str) -> None:
        """PERMISSION_DENIED (``AGENT_NOT_VERIFIED``) unless what serves at ``address`` is the
        sandbox's agent."""
        if self._verify is not None and not await _verified(self._verify, sandbox_id, address):
            raise OrchardError(
                EnvReason.AGENT_NOT_VERIFIED,
                f"sandbox {sandbox_id!r}: what serves at its agent's address is not the "
                "agent its runtime started; nothing was sent to it",
                metadata={"sandbox_id": sandbox_id},
            )

    def drop(self, sandbox_id: str) -> None:
        """Close the sandbox's channel (it is gone); calls in flight on it fail."""
        link = self._links.pop(sandbox_id, None)
        if link is not None:
            self._close_later(link, "the sandbox failed or is being deleted")

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        for link in links:
            link.closed = "the service is stopping"
        await asyncio.gather(*(link.close() for link in links), return_exceptions=True)
        await asyncio.gather(*self._closing, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._links)

    def _close_later(self, link: AgentLink, why: str) -> None:
        link.closed = why
        task = asyncio.get_running_loop().create_task(link.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


async def _verified(
    verify: Callable[[str, str], Awaitable[bool]], sandbox_id: str, address: str
) -> bool:
    """The runtime's verdict; UNAVAILABLE (not cached, the next call asks again) when it
    cannot tell now."""
    try:
        return await verify(sandbox_id, address)
    except AgentUnreachable as exc:
        raise OrchardError(
            EnvReason.AGENT_UNAVAILABLE,
            f"sandbox {sandbox_id!r}: cannot check its agent's identity now ({exc}); "
            "nothing was sent to it, retry",
            metadata={"sandbox_id": sandbox_id},
        ) from None


async def _agent_key(
    key: Callable[[str], Awaitable[bytes | None]], sandbox_id: str
) -> bytes | None:
    """The runtime's key for the sandbox's agent; UNAVAILABLE when it cannot be read now."""
    try:
        return await key(sandbox_id)
    except AgentUnreachable as exc:
        raise OrchardError(
            EnvReason.AGENT_UNAVAILABLE,
            f"sandbox {sandbox_id!r}: cannot read its agent's key now ({exc}); "
            "nothing was sent to it, retry",
            metadata={"sandbox_id": sandbox_id},
        ) from None
