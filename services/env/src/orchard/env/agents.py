"""Connections to sandbox agents: one cached grpc.aio channel and one lock per sandbox."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from orchard.inagent.v1 import inagent_service_pb2_grpc

__all__ = ["AgentLink", "AgentLinks"]

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # Agents are local or one hop away; reconnect fast after a blip instead of backing off.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass
class AgentLink:
    """The way to one sandbox's agent.

    ``lock`` serializes this replica's calls to the sandbox: a call holds it from start to
    end, and a streaming call (ExecStream, ReadFile, WriteFile) for as long as it streams.
    """

    sandbox_id: str
    address: str
    channel: grpc.aio.Channel
    stub: inagent_service_pb2_grpc.AgentServiceStub
    lock: asyncio.Lock


class AgentLinks:
    """Channels and locks by sandbox id, created on first use, closed when the sandbox goes."""

    def __init__(self) -> None:
        self._links: dict[str, AgentLink] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, sandbox_id: str, address: str) -> AgentLink:
        link = self._links.get(sandbox_id)
        if link is not None and link.address == address:
            return link
        if link is not None:
            self._close_later(link)
        channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        link = AgentLink(
            sandbox_id,
            address,
            channel,
            inagent_service_pb2_grpc.AgentServiceStub(channel),
            link.lock if link is not None else asyncio.Lock(),
        )
        self._links[sandbox_id] = link
        return link

    def drop(self, sandbox_id: str) -> None:
        """Close the sandbox's channel (it is gone); calls in flight on it fail."""
        link = self._links.pop(sandbox_id, None)
        if link is not None:
            self._close_later(link)

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        await asyncio.gather(*(link.channel.close() for link in links), return_exceptions=True)
        await asyncio.gather(*self._closing, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._links)

    def _close_later(self, link: AgentLink) -> None:
        task = asyncio.get_running_loop().create_task(link.channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
