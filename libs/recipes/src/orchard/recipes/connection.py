"""A gRPC connection to one of the services a recipe drives, with its errors said plainly.

A recipe runs for hours against services that may restart or briefly lose their state store,
so a call that may be repeated (a read, or a create carrying a request id) is tried again when
the service answers UNAVAILABLE, backing off up to `ServiceConnection.retry_for_s`; a call
that would act twice (a training step, a stream of groups submitted) is tried once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import grpc

__all__ = ["Backoff", "ServiceConnection", "ServiceError", "retryable"]

log = logging.getLogger(__name__)


class ServiceError(RuntimeError):
    """A service refused or failed a call; the message is the service's, with the call."""


def retryable(error: grpc.aio.AioRpcError) -> bool:
    """Whether a call that failed with `error` may simply be made again: the service said it
    is temporarily unavailable (restarting, unreachable, or its state store did not answer)."""
    return bool(error.code() == grpc.StatusCode.UNAVAILABLE)


@dataclass
class ServiceConnection:
    """A channel to ``address`` (HOST:PORT) and the service's stub, opened by ``async with``."""

    address: str
    service: ClassVar[str] = ""
    """The program's name, for messages (e.g. "orchard-trainer")."""
    error: ClassVar[type[ServiceError]] = ServiceError
    retry_for_s: float = 120.0
    """How long a repeatable call keeps being tried while the service answers UNAVAILABLE."""
    _channel: grpc.aio.Channel | None = None
    _stub: Any = None

    def stub(self, channel: grpc.aio.Channel) -> Any:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        self._channel = grpc.aio.insecure_channel(self.address)
        self._stub = self.stub(self._channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._channel is not None:
            await self._channel.close()

    def _failed(self, what: str, exc: grpc.aio.AioRpcError) -> ServiceError:
        return self.error(self._describe(what, exc))

    async def _call(self, what: str, call: Awaitable[Any]) -> Any:
        """One attempt of a call that must not be repeated blindly."""
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise self._failed(what, exc) from None

    async def _retried(self, what: str, start: Callable[[], Awaitable[Any]]) -> Any:
        """A repeatable call (`start` makes a fresh attempt), tried again while the service
        answers UNAVAILABLE, for up to `retry_for_s`."""
        backoff = Backoff(self.retry_for_s)
        while True:
            try:
                return await start()
            except grpc.aio.AioRpcError as exc:
                if not retryable(exc) or not await backoff.wait(self._describe(what, exc)):
                    raise self._failed(what, exc) from None

    def _describe(self, what: str, exc: grpc.aio.AioRpcError) -> str:
        return f"{self.service} at {self.address}: {what}: {exc.code().name}: {exc.details()}"


class Backoff:
    """Waits between attempts of one call: 0.5 s doubling to 8 s, for up to `budget_s` in all
    (`reset` after progress starts the budget anew)."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.reset()

    def reset(self) -> None:
        self._deadline = time.monotonic() + self.budget_s
        self._delay = 0.5

    async def wait(self, why: str) -> bool:
        """Sleep before the next attempt; False when the budget is spent (give up)."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            return False
        delay = min(self._delay, left)
        log.warning("%s; trying again in %.1f s", why, delay)
        await asyncio.sleep(delay)
        self._delay = min(self._delay * 2, 8.0)
        return True
