"""The recipe's side of the weight registry, through orchard-trainer's RPCs.

A run reads the versions its jobs published (GetWeightVersion) and publishes its starting
model (PublishModel: a built-in model is built by the trainer from the run's seed, so this
process never loads torch and never reaches etcd).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import grpc

from orchard.recipes.connection import ServiceConnection, ServiceError
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.trainer.v1 import trainer_service_pb2_grpc as rpc

__all__ = ["WeightVersions", "WeightsError"]


class WeightsError(ServiceError):
    """orchard-trainer refused a weight call; the message is the service's, with the call."""


@dataclass
class WeightVersions(ServiceConnection):
    """Published weight versions of registry models, through orchard-trainer at ``address``."""

    service = "orchard-trainer"
    error = WeightsError

    def stub(self, channel: grpc.aio.Channel) -> Any:
        return rpc.TrainerServiceStub(channel)

    async def get(self, model: str, version: str) -> api.WeightVersion | None:
        """`version` of `model`, or None when it was never published."""
        request = api.GetWeightVersionRequest(model=model, version=version)

        async def attempt() -> api.WeightVersion | None:
            try:
                response = await self._stub.GetWeightVersion(request)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return None
                raise
            found: api.WeightVersion = response.weight_version
            return found

        found: api.WeightVersion | None = await self._retried("GetWeightVersion", attempt)
        return found

    async def list(self, model: str) -> list[api.WeightVersion]:
        """Every published version of `model`, oldest first."""
        out: list[api.WeightVersion] = []
        token = ""
        while True:
            request = api.ListWeightVersionsRequest(model=model, page_token=token)
            response = await self._retried(
                "ListWeightVersions",
                functools.partial(self._stub.ListWeightVersions, request),
            )
            out += response.weight_versions
            token = response.next_page_token
            if not token:
                return out

    async def publish_model(
        self, model: str, weight_model: str, version: str, seed: int
    ) -> api.WeightVersion:
        """`model` ("builtin:<size>", built by the trainer from `seed`, or a model folder's
        URL) published as `version` of `weight_model`; the existing version when it already
        is (from the same model and seed)."""
        request = api.PublishModelRequest(
            model=model, weight_model=weight_model, version=version, seed=seed
        )
        response = await self._retried("PublishModel", lambda: self._stub.PublishModel(request))
        published: api.WeightVersion = response.weight_version
        return published
