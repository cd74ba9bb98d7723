"""``orchard-reward``: the reward service process.

::

    orchard-reward --listen 127.0.0.1:7200 --env 127.0.0.1:7100 --metrics-address 127.0.0.1:9200
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys

from orchard.core.config import ConfigFlag
from orchard.core.config_sources import SERVER_FLAGS
from orchard.core.server import (
    GrpcServer,
    ServiceBinding,
    application_server,
    run_application,
)
from orchard.reward.config import JudgeConfig, RewardConfig
from orchard.reward.judge_client import Judge, OpenAIJudge
from orchard.reward.metrics import RewardMetrics
from orchard.reward.scripted_judge import ScriptedJudge
from orchard.reward.service import RewardResources, RewardServicer
from orchard.reward.v1 import reward_service_pb2_grpc

__all__ = ["SERVICE_NAME", "RewardApplication", "main"]

log = logging.getLogger(__name__)

SERVICE_NAME = "orchard.reward.v1.RewardService"

FLAGS = [
    *SERVER_FLAGS,
    ConfigFlag("--env", "env.endpoint", "gRPC address of orchard-env", metavar="ADDRESS"),
]


class RewardApplication:
    """The servicer, and on start the judges and the environment service client.

    ``run_application`` drives it in the ``orchard-reward`` process; tests drive it around a
    :class:`GrpcServer` of their own (:meth:`server`).
    """

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        # Metrics are bound on start, when the server's registry exists.
        self.servicer = RewardServicer(config, RewardMetrics(None))
        self._resources: RewardResources | None = None

    def bindings(self) -> list[ServiceBinding]:
        return [
            ServiceBinding.servicer(
                SERVICE_NAME,
                reward_service_pb2_grpc.add_RewardServiceServicer_to_server,
                self.servicer,
            )
        ]

    async def start(self, server: GrpcServer) -> None:
        config = self.config
        metrics = RewardMetrics(server.metrics)
        self.servicer.metrics = metrics
        # Endpoints (and their API keys) first: a missing key fails the start, opening nothing.
        endpoints = {
            name: judge.endpoint()
            for name, judge in config.judges.items()
            if isinstance(judge, JudgeConfig)
        }
        judges: dict[str, Judge] = {}
        for name, judge in config.judges.items():
            if isinstance(judge, JudgeConfig):
                retry = functools.partial(metrics.judge_retry, name)
                judges[name] = OpenAIJudge(endpoints[name], on_retry=retry)
            else:
                judges[name] = ScriptedJudge(judge.model)
        env = None
        if config.env.endpoint:
            env = config.env.client(config.env.endpoint)
        self._resources = RewardResources(judges, env)
        self.servicer.attach(self._resources)
        log.info(
            "reward service ready",
            extra={"judges": sorted(judges), "env_endpoint": config.env.endpoint},
        )

    async def stop(self) -> None:
        self.servicer.attach(None)
        resources, self._resources = self._resources, None
        if resources is None:
            return
        for judge in resources.judges.values():
            with contextlib.suppress(Exception):
                await judge.close()
        if resources.env is not None:
            with contextlib.suppress(Exception):
                await resources.env.close()

    def server(self) -> GrpcServer:
        """A server for this application (tests and embedding)."""
        return application_server("reward", self, self.config.server)


def main() -> None:
    sys.exit(
        run_application(
            "reward",
            RewardConfig,
            RewardApplication,
            description="The Orchard reward service: test rewards, LLM judge, rubric, credit.",
            flags=FLAGS,
        )
    )


if __name__ == "__main__":
    main()
