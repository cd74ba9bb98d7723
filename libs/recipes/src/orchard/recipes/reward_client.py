"""The recipe's side of orchard-reward's catalogue: the task suites it knows (ListTaskSuites),
so a recipe checks its built-in task settings against the service that scores them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from orchard.recipes.connection import ServiceConnection, ServiceError
from orchard.reward.v1 import reward_service_pb2 as api
from orchard.reward.v1 import reward_service_pb2_grpc as rpc

__all__ = ["RewardCatalog", "RewardError"]


class RewardError(ServiceError):
    """orchard-reward refused a call; the message is the service's, with the call."""


@dataclass
class RewardCatalog(ServiceConnection):
    """What orchard-reward at ``address`` (HOST:PORT) knows and scores."""

    service = "orchard-reward"
    error = RewardError

    def stub(self, channel: grpc.aio.Channel) -> Any:
        return rpc.RewardServiceStub(channel)

    async def task_suites(self) -> dict[str, api.TaskSuite]:
        """The task suites by name."""
        response = await self._retried(
            "ListTaskSuites", lambda: self._stub.ListTaskSuites(api.ListTaskSuitesRequest())
        )
        return {suite.name: suite for suite in response.suites}
