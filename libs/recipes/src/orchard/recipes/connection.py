"""A gRPC connection to one of the services a recipe drives, with its errors said plainly.

A recipe runs for hours against services that may restart or briefly lose their state store,
so a call that may be repeated (a read, or a create carrying a request id) is tried again when
the service answers UNAVAILABLE, with the SDK's backoff (`orchard.sdk.retry.RetryPolicy`,
about a minute in all by default); a call that would act twice (a training step, a stream of
groups submitted) is tried once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import grpc

from orchard.sdk.retry import RetryPolicy

__all__ = ["RECIPE_RETRY", "ServiceConnection", "ServiceError"]

log = logging.getLogger(__name__)

RECIPE_RETRY = RetryPolicy(max_attempts=16, initial_backoff=0.5, max_backoff=10.0)
"""Long enough for a service to restart (about a minute of waits on average, two at most)."""


class ServiceError(RuntimeError):
    """A service refused or failed a call; the message is the service's, with the call."""


@dataclass
class ServiceConnection:
    """A channel to ``address`` (HOST:PORT) and the service's stub, opened by ``async with``."""

    address: str
    service: ClassVar[str] = ""
    """The program's name, for messages (e.g. "orchard-trainer")."""
    error: ClassVar[type[ServiceError]] = ServiceError
    retry: RetryPolicy = RECIPE_RETRY
    """How a repeatable call is tried again while the service answers UNAVAILABLE."""
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
        return self.error(
            f"{self.service} at {self.address}: {what}: {exc.code().name}: {exc.details()}"
        )

    async def _call(self, what: str, call: Awaitable[Any]) -> Any:
        """One attempt of a call that must not be repeated blindly."""
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise self._failed(what, exc) from None

    async def _retried(self, what: str, start: Callable[[], Awaitable[Any]]) -> Any:
        """A repeatable call (`start` makes a fresh attempt), tried again while the service
        answers UNAVAILABLE, as `retry` allows."""
        attempt = 0
        while True:
            try:
                return await start()
            except grpc.aio.AioRpcError as exc:
                await self._again(what, exc, attempt)
                attempt += 1

    async def _again(self, what: str, exc: grpc.aio.AioRpcError, attempt: int) -> None:
        """Waits before attempt `attempt + 1` of a repeatable call that failed with `exc`; raises
        the call's error when the failure is not retryable or the attempts are spent."""
        if not self.retry.should_retry(exc.code(), attempt):
            raise self._failed(what, exc) from None
        delay = self.retry.backoff(attempt)
        log.warning(
            "%s at %s: %s: %s: %s; trying again in %.1f s",
            self.service,
            self.address,
            what,
            exc.code().name,
            exc.details(),
            delay,
        )
        await asyncio.sleep(delay)
