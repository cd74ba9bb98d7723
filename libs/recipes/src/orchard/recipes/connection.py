"""A gRPC connection to one of the services a recipe drives, with its errors said plainly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

import grpc

__all__ = ["ServiceConnection", "ServiceError"]


class ServiceError(RuntimeError):
    """A service refused or failed a call; the message is the service's, with the call."""


@dataclass
class ServiceConnection:
    """A channel to ``address`` (HOST:PORT) and the service's stub, opened by ``async with``."""

    address: str
    service: ClassVar[str] = ""
    """The program's name, for messages (e.g. "orchard-trainer")."""
    error: ClassVar[type[ServiceError]] = ServiceError
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

    async def _call(self, what: str, call: Any) -> Any:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise self.error(
                f"{self.service} at {self.address}: {what}: {exc.code().name}: {exc.details()}"
            ) from None
