"""The direct route: exec calls and file reads that go straight to a sandbox's agent, not
through orchard-env.

With ``AsyncSandboxClient(direct_agent=True)`` the client asks the service once per sandbox for
a route (``EnvService.OpenAgentRoute``: the agent's address and a short-lived credential for
that sandbox alone), keeps it until shortly before it expires, then opens a new one. The
service is then off the exec path: one hop instead of two, and none of its CPU.

It falls back to the service, per sandbox, whenever the route is not usable:

- the service gives no route (an older service, a runtime whose agents hold no key, the route
  turned off, or the sandbox not READY: the service's own call then says why);
- the agent's address does not connect within ``probe_timeout_s`` (a client on another host
  than a local sandbox, or outside the cluster's network policy), or its connection is down
  when a call starts;
- the agent refuses the credential (expired on a skewed clock, an agent without a key): the
  agent refused before running anything, so the call goes through the service instead;
- a call fails UNAVAILABLE on a route that had no connection when it started (the sandbox was
  deleted, its agent died): nothing reached an agent, and the service's own answer says what
  became of the sandbox.

A sandbox whose route failed is not tried again for ``retry_after_s``. An exec that fails after
the agent accepted it is not repeated on the other route (the command may have run): it
raises as the service's route would. A read, safe to repeat, resumes through the service from
the byte it reached.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from orchard.inagent.v1 import inagent_service_pb2_grpc

__all__ = ["AgentRoute", "AgentRoutes"]

_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
_DOWN = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)
REFUSED_BEFORE_RUNNING = frozenset(
    {"CREDENTIAL_INVALID", "CREDENTIAL_WRONG_SANDBOX", "AGENT_KEY_MISSING"}
)
"""Agent error reasons that mean the call was refused before anything ran."""


@dataclass
class AgentRoute:
    """An open route to one sandbox's agent."""

    address: str
    credential: str
    expire_unix_s: float
    channel: grpc.aio.Channel
    stub: inagent_service_pb2_grpc.AgentServiceStub

    @property
    def metadata(self) -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {self.credential}"),)

    def connected(self) -> bool:
        """Not known to be down (connected, connecting or idle)."""
        return self.channel.get_state(try_to_connect=False) not in _DOWN

    def ready(self) -> bool:
        """Connected now."""
        state: grpc.ChannelConnectivity = self.channel.get_state(try_to_connect=False)
        return state is grpc.ChannelConnectivity.READY


class AgentRoutes:
    """Routes by sandbox id (see the module docstring). ``open_route(sandbox_id)`` calls
    ``EnvService.OpenAgentRoute`` and returns its response, or raises ``grpc.RpcError``."""

    def __init__(
        self,
        open_route: Callable[[str], Awaitable[Any]],
        *,
        renew_before_s: float = 30.0,
        probe_timeout_s: float = 1.0,
        retry_after_s: float = 30.0,
    ) -> None:
        self._open_route = open_route
        self.renew_before_s = renew_before_s
        self.probe_timeout_s = probe_timeout_s
        self.retry_after_s = retry_after_s
        self._routes: dict[str, AgentRoute] = {}
        self._down_until: dict[str, float] = {}  # sandbox id → monotonic time
        self._locks: dict[str, asyncio.Lock] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self.opened = 0
        """Routes opened so far (OpenAgentRoute calls that gave a usable route)."""
        self.fallbacks = 0
        """Calls that went through the service because the route was not usable."""

    async def get(self, sandbox_id: str) -> AgentRoute | None:
        """The sandbox's route, opened or renewed as needed; None: use the service."""
        route = await self._get(sandbox_id)
        if route is None:
            self.fallbacks += 1
        return route

    async def _get(self, sandbox_id: str) -> AgentRoute | None:
        route = self._routes.get(sandbox_id)
        if route is not None and time.time() < route.expire_unix_s - self.renew_before_s:
            if route.connected():
                return route
            self.mark_down(sandbox_id)
            return None
        if self._down_until.get(sandbox_id, 0.0) > time.monotonic():
            return None
        async with self._locks.setdefault(sandbox_id, asyncio.Lock()):
            route = self._routes.get(sandbox_id)
            if route is not None and time.time() < route.expire_unix_s - self.renew_before_s:
                return route
            return await self._open(sandbox_id, route)

    async def _open(self, sandbox_id: str, old: AgentRoute | None) -> AgentRoute | None:
        try:
            reply = await self._open_route(sandbox_id)
        except grpc.RpcError:
            # The service's own call on the fallback route says what is wrong, if anything.
            self.mark_down(sandbox_id)
            return None
        expire = reply.expire_time.ToNanoseconds() / 1e9
        if old is not None and old.address == reply.address and old.connected():
            old.credential, old.expire_unix_s = reply.credential, expire
            return old
        channel = grpc.aio.insecure_channel(reply.address, options=_CHANNEL_OPTIONS)
        try:
            await asyncio.wait_for(channel.channel_ready(), self.probe_timeout_s)
        except (TimeoutError, grpc.RpcError):
            await channel.close()
            self.mark_down(sandbox_id)
            return None
        if old is not None:
            await old.channel.close()
        route = AgentRoute(
            reply.address,
            reply.credential,
            expire,
            channel,
            inagent_service_pb2_grpc.AgentServiceStub(channel),
        )
        self._routes[sandbox_id] = route
        self.opened += 1
        return route

    def mark_down(self, sandbox_id: str) -> None:
        """Use the service for this sandbox for ``retry_after_s``, then try a route again."""
        self._down_until[sandbox_id] = time.monotonic() + self.retry_after_s
        route = self._routes.pop(sandbox_id, None)
        if route is not None:
            self._close_later(route)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: drop its route."""
        self._down_until.pop(sandbox_id, None)
        self._locks.pop(sandbox_id, None)
        route = self._routes.pop(sandbox_id, None)
        if route is not None:
            self._close_later(route)

    async def close(self) -> None:
        routes, self._routes = list(self._routes.values()), {}
        await asyncio.gather(*(r.channel.close() for r in routes), return_exceptions=True)
        await asyncio.gather(*self._closing, return_exceptions=True)

    def _close_later(self, route: AgentRoute) -> None:
        task = asyncio.get_running_loop().create_task(route.channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
