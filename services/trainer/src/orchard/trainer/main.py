"""``orchard-trainer serve``: the trainer service process.

::

    orchard-trainer serve --listen 127.0.0.1:7300 --etcd http://127.0.0.1:2379 \\
        --metrics-address 127.0.0.1:9300 --artifacts-root file:///srv/orchard/artifacts
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from orchard.core.config import ConfigFlag
from orchard.core.config_sources import SERVER_FLAGS
from orchard.core.etcd import EtcdStore
from orchard.core.server import GrpcServer, ServiceBinding, application_server, run_application
from orchard.lm.weights import WeightRegistry
from orchard.trainer.config import TrainerConfig
from orchard.trainer.metrics import TrainerMetrics
from orchard.trainer.records import JobStore
from orchard.trainer.service import JobManager, TrainerServicer
from orchard.trainer.v1 import trainer_service_pb2_grpc

__all__ = ["SERVICE_NAME", "TrainerApplication", "serve"]

log = logging.getLogger(__name__)

SERVICE_NAME = "orchard.trainer.v1.TrainerService"

FLAGS = [
    *SERVER_FLAGS,
    ConfigFlag(
        "--etcd", "etcd.endpoints", "etcd client URL (repeatable)", repeatable=True, metavar="URL"
    ),
    ConfigFlag(
        "--artifacts-root",
        "artifacts.root",
        "URL of the artifact store (checkpoints go to <root>/checkpoints)",
        metavar="URL",
    ),
    ConfigFlag(
        "--scratch-dir",
        "weights.scratch_dir",
        "local folder for checkpoints being written",
        metavar="DIR",
    ),
]


class TrainerApplication:
    """The servicer, and on start the etcd stores, the weight registry and the jobs (those a
    previous process left running are resumed).

    ``run_application`` drives it in the ``orchard-trainer serve`` process; tests drive it
    around a :class:`GrpcServer` of their own (:meth:`server`).
    """

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.servicer = TrainerServicer()
        self.jobs: JobManager | None = None
        self._stores: list[EtcdStore] = []

    def bindings(self) -> list[ServiceBinding]:
        return [
            ServiceBinding.servicer(
                SERVICE_NAME,
                trainer_service_pb2_grpc.add_TrainerServiceServicer_to_server,
                self.servicer,
            )
        ]

    async def start(self, server: GrpcServer) -> None:
        etcd = self.config.etcd
        jobs_store = EtcdStore(etcd.endpoints, namespace=etcd.prefix, timeout=etcd.timeout_s)
        weights_store = EtcdStore(
            etcd.endpoints, namespace=etcd.weights_prefix, timeout=etcd.timeout_s
        )
        for store in (jobs_store, weights_store):
            await store.connect()
            self._stores.append(store)
        self.jobs = JobManager(
            self.config,
            JobStore(jobs_store),
            WeightRegistry(weights_store, self.config.weights.registry_model),
            TrainerMetrics(server.metrics),
        )
        await self.jobs.recover()
        self.servicer.attach(self.jobs)
        log.info(
            "trainer service ready",
            extra={
                "artifacts_root": self.config.artifacts.root,
                "checkpoint_url": self.config.checkpoint_url(),
                "registry_model": self.config.weights.registry_model,
            },
        )

    async def stop(self) -> None:
        self.servicer.attach(None)
        if self.jobs is not None:
            await self.jobs.close()
            self.jobs = None
        for store in self._stores:
            with contextlib.suppress(Exception):
                await store.close()
        self._stores.clear()

    def server(self) -> GrpcServer:
        """A server for this application (tests and embedding)."""
        return application_server("trainer", self, self.config.server)


def serve(argv: Sequence[str] | None = None) -> int:
    """Run the service until SIGTERM/SIGINT; the exit status."""
    return run_application(
        "trainer",
        TrainerConfig,
        TrainerApplication,
        description="The Orchard trainer service: training jobs, checkpoints, weight versions.",
        flags=FLAGS,
        argv=argv,
    )
