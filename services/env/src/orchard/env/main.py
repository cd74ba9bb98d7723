"""``orchard-env``: the environment service process.

::

    orchard-env --listen 127.0.0.1:7100 --set etcd.endpoints=http://127.0.0.1:2379
"""

from __future__ import annotations

import contextlib
import logging
import sys

from orchard.core.config import ConfigFlag
from orchard.core.config_sources import SERVER_FLAGS
from orchard.core.etcd import EtcdStore
from orchard.core.server import (
    GrpcServer,
    ServiceBinding,
    application_server,
    run_application,
)
from orchard.env.config import EnvConfig
from orchard.env.controller import SandboxController
from orchard.env.metrics import EnvMetrics
from orchard.env.runtime.base import Runtime
from orchard.env.runtime_loader import load_runtime
from orchard.env.service import EnvServicer
from orchard.env.v1 import env_service_pb2_grpc

__all__ = ["EnvApplication", "main"]

log = logging.getLogger(__name__)

SERVICE_NAME = "orchard.env.v1.EnvService"

FLAGS = [
    *SERVER_FLAGS,
    ConfigFlag(
        "--etcd", "etcd.endpoints", "etcd client URL (repeatable)", repeatable=True, metavar="URL"
    ),
]


class EnvApplication:
    """One replica: the servicer, and on start the store, the runtime and the controller.

    ``run_service`` drives it in the ``orchard-env`` process; tests drive it around a
    :class:`GrpcServer` of their own, optionally with a runtime they built.
    """

    def __init__(self, config: EnvConfig, *, runtime: Runtime | None = None) -> None:
        self.config = config
        self.servicer = EnvServicer(config)
        self._runtime = runtime
        self._owns_runtime = runtime is None
        self.store: EtcdStore | None = None
        self.controller: SandboxController | None = None

    def bindings(self) -> list[ServiceBinding]:
        return [
            ServiceBinding.servicer(
                SERVICE_NAME, env_service_pb2_grpc.add_EnvServiceServicer_to_server, self.servicer
            )
        ]

    async def start(self, server: GrpcServer) -> None:
        config = self.config
        runtime = self._runtime if self._runtime is not None else load_runtime(config.runtime)
        self._runtime = runtime
        if self._owns_runtime:
            await runtime.start()
        self.store = EtcdStore(
            config.etcd.endpoints, namespace=config.etcd.prefix, timeout=config.etcd.timeout_s
        )
        await self.store.connect()
        self.controller = SandboxController(self.store, runtime, config, EnvMetrics(server.metrics))
        await self.controller.start()
        self.servicer.attach(self.controller)

    async def stop(self) -> None:
        self.servicer.attach(None)
        if self.controller is not None:
            await self.controller.close()
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.close()
        if self._runtime is not None and self._owns_runtime:
            await self._runtime.close()

    def server(self) -> GrpcServer:
        """A server for this application (tests and embedding)."""
        return application_server("env", self, self.config.server)


def main() -> None:
    sys.exit(
        run_application(
            "env",
            EnvConfig,
            EnvApplication,
            description="The Orchard environment service: sandboxes, exec, files.",
            flags=FLAGS,
        )
    )


if __name__ == "__main__":
    main()
