"""``orchard-rollout``: the rollout service process.

::

    orchard-rollout --listen 127.0.0.1:7300 --env 127.0.0.1:7100 --reward 127.0.0.1:7200 \\
        --etcd http://127.0.0.1:2379 --metrics-address 127.0.0.1:9300
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Mapping

from orchard.core.config import ConfigFlag, config_from_args
from orchard.core.config_sources import SERVER_FLAGS
from orchard.core.etcd import EtcdStore
from orchard.core.server import GrpcServer, ServiceBinding, application_server, run_application
from orchard.rollout.config import RolloutConfig
from orchard.rollout.engine_pool import check_engines
from orchard.rollout.metrics import RolloutMetrics
from orchard.rollout.runs import JobStore
from orchard.rollout.scoring import LocalScorer, RewardServiceScorer, TaskScorer
from orchard.rollout.service import RolloutManager, RolloutServicer
from orchard.rollout.task_files import StoreFiles
from orchard.rollout.v1 import rollout_service_pb2_grpc
from orchard.rollout.workers import RayWorkers, WorkerServices

__all__ = ["SERVICE_NAME", "RolloutApplication", "main"]

log = logging.getLogger(__name__)

SERVICE_NAME = "orchard.rollout.v1.RolloutService"

FLAGS = [
    *SERVER_FLAGS,
    ConfigFlag("--env", "env.endpoint", "gRPC address of orchard-env", metavar="ADDRESS"),
    ConfigFlag("--reward", "reward.endpoint", "gRPC address of orchard-reward", metavar="ADDRESS"),
    ConfigFlag("--etcd", "etcd.endpoints", "etcd client URL", metavar="URL"),
]


class RolloutApplication:
    """The servicer, and on start the job store, the clients and the jobs to resume.

    ``run_application`` drives it in the ``orchard-rollout`` process; tests and embedders
    drive it around a :class:`GrpcServer` of their own (:meth:`server`).
    """

    def __init__(self, config: RolloutConfig) -> None:
        self.config = config
        self.servicer = RolloutServicer()
        self.manager: RolloutManager | None = None
        self._closers: list[contextlib.AsyncExitStack] = []

    def bindings(self) -> list[ServiceBinding]:
        return [
            ServiceBinding.servicer(
                SERVICE_NAME,
                rollout_service_pb2_grpc.add_RolloutServiceServicer_to_server,
                self.servicer,
            )
        ]

    async def start(self, server: GrpcServer) -> None:
        config = self.config
        check_engines(config)  # e.g. kind vllm without vLLM: refused before anything connects
        stack = contextlib.AsyncExitStack()
        self._closers.append(stack)
        store = await stack.enter_async_context(
            EtcdStore(
                config.etcd.endpoints,
                namespace=config.etcd.namespace,
                timeout=config.etcd.timeout_s,
            )
        )
        sandboxes = await stack.enter_async_context(config.env.client(config.env.endpoint))
        scorer: TaskScorer = LocalScorer()
        if config.reward.endpoint:
            scorer = await stack.enter_async_context(
                RewardServiceScorer(
                    config.reward.endpoint, call_timeout_s=config.reward.call_timeout_s
                )
            )
        registry = None
        if config.job_policies.allow or any(
            p.kind != "openai" and not p.engine.model_folder for p in config.policies.values()
        ):
            from orchard.lm.weights import WeightRegistry  # noqa: PLC0415

            weights = await stack.enter_async_context(
                EtcdStore(
                    config.etcd.endpoints,
                    namespace=config.etcd.weights_namespace,
                    timeout=config.etcd.timeout_s,
                )
            )
            # One registry handle; each policy asks it for its own model's versions.
            registry = WeightRegistry(weights, "policy")
        workers = None
        if config.workers.kind == "ray":
            # Entered after the clients: closed first, once the manager stopped the jobs.
            workers = await stack.enter_async_context(
                RayWorkers.of(config.workers, WorkerServices.of(config))
            )
        artifacts = config.artifacts.store()  # task archives are read, GUI trails written here
        self.manager = RolloutManager(
            config=config,
            jobs=JobStore(store),
            sandboxes=sandboxes,
            scorer=scorer,
            metrics=RolloutMetrics(server.metrics),
            registry=registry,
            files=StoreFiles(artifacts),
            trails=artifacts,
            workers=workers,
        )
        await self.manager.open()
        self.servicer.attach(self.manager)
        log.info(
            "rollout service ready",
            extra={
                "env_endpoint": config.env.endpoint,
                "reward_endpoint": config.reward.endpoint,
                "policies": sorted(config.policies),
            },
        )

    async def stop(self) -> None:
        self.servicer.attach(None)
        manager, self.manager = self.manager, None
        if manager is not None:
            await manager.close()
        while self._closers:
            with contextlib.suppress(Exception):
                await self._closers.pop().aclose()

    def server(self) -> GrpcServer:
        """A server for this application (tests and embedding)."""
        return application_server("rollout", self, self.config.server)


def load_config(args: argparse.Namespace, env: Mapping[str, str], env_prefix: str) -> RolloutConfig:
    """The configuration from its layers, refused (exit status 2, the keys named) when it
    selects an engine this environment cannot run, e.g. kind vllm without vLLM."""
    config = config_from_args(RolloutConfig, args, env=env, env_prefix=env_prefix)
    check_engines(config)
    return config


def main() -> None:
    sys.exit(
        run_application(
            "rollout",
            load_config,
            RolloutApplication,
            description="The Orchard rollout service: rollout jobs, scored groups for training.",
            flags=FLAGS,
        )
    )


if __name__ == "__main__":
    main()
