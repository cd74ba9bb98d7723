"""``orchard-inagent``: run the agent until SIGTERM.

    orchard-inagent --listen unix:/run/orchard/inagent.sock --working-dir /workspace
    orchard-inagent --listen 127.0.0.1:0 --address-file /run/orchard/inagent.addr
    orchard-inagent --listen unix:/run/orchard/inagent.sock --ready-fd 3
    orchard-inagent --listen unix:/run/orchard/inagent.sock --lane unix:/run/orchard/inagent.lane

Logs are JSON lines on stderr; nothing else is printed. With ``--lane`` the agent also serves
orchard-env's Exec calls in a lean framing there (:mod:`orchard.inagent.exec_lane`); with
``--grpc-on-demand true`` as well, it serves only the lane until a lane call asks it to start
gRPC (the ready report then names the lane, and the ``--listen-dir-fd`` directory stays open
until gRPC has bound in it). Health
turns SERVING once every address is bound (and the address file, if asked for, is written).
With ``--ready-fd N`` the agent then writes the bound addresses, one per line, to the inherited
descriptor N and closes it: whoever started it (the local sandbox runtime) learns readiness from
end-of-file, with no polling. On SIGTERM the server drains (in-flight calls get
``server.grace_period_s``, then are cancelled, which kills their process groups), then every
process group the agent started that is still alive is killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence

from orchard.core.errors import OrchardError, Reason
from orchard.core.server import GrpcServer, ServiceBinding, run_service
from orchard.inagent.config import AGENT_FLAGS, AgentConfig, load_agent_config
from orchard.inagent.credentials import CredentialCheck, CredentialInterceptor
from orchard.inagent.exec_lane import ExecLane
from orchard.inagent.process import ProcessSupervisor
from orchard.inagent.service import SERVICE_NAME, AgentServicer

__all__ = ["main", "run"]

log = logging.getLogger(__name__)


KEY_VARIABLE = "ORCHARD_AGENT_KEY"
"""The sandbox's key, from the runtime that started the agent (a Kubernetes Secret): the agent
proves with it, over AgentService.ProveIdentity, that it is the agent the runtime started, and
checks route credentials with it (:mod:`orchard.inagent.credentials`)."""
SANDBOX_ID_VARIABLE = "ORCHARD_AGENT_SANDBOX_ID"
"""The sandbox this agent serves, from the runtime: a route credential for another is refused
by name (without it, by its signature alone)."""


class _Agent:
    """What lives as long as the server: the process supervisor and the start/stop hooks."""

    def __init__(self, identity_key: bytes | None = None, sandbox_id: str | None = None) -> None:
        self.supervisor: ProcessSupervisor | None = None
        self.servicer: AgentServicer | None = None
        self.lane: ExecLane | None = None
        self.server: GrpcServer | None = None
        self.config: AgentConfig | None = None
        self.identity_key = identity_key
        self.credentials = CredentialCheck(identity_key, sandbox_id)
        # Its `required` setting arrives with the configuration, after the server's interceptors.
        self.interceptor = CredentialInterceptor(self.credentials)

    def bindings(self, config: AgentConfig) -> list[ServiceBinding]:
        # Called on the running event loop, before the server binds: commands can run as soon
        # as a call arrives.
        if config.ready_fd is not None:
            # Commands must not inherit the starter's pipe: its end-of-file means "ready".
            os.set_inheritable(config.ready_fd, False)
        if config.listen_dir_fd is not None:
            os.set_inheritable(config.listen_dir_fd, False)
        self.interceptor.required = config.require_credential
        self.supervisor = ProcessSupervisor(reap_orphans=config.should_reap_orphans())
        self.supervisor.start()
        self.servicer = AgentServicer(
            supervisor=self.supervisor,
            working_dir=config.resolved_working_dir(),
            base_env=config.base_env(),
            limits=config.limits,
            shell=config.shell,
            identity_key=self.identity_key,
        )
        return [ServiceBinding(SERVICE_NAME, self.servicer.register)]

    async def on_start(self, config: AgentConfig, server: GrpcServer) -> None:
        self.server, self.config = server, config
        if config.lane and self.servicer is not None:
            # Bound before the directory handle closes and before anyone hears "ready".
            self.lane = ExecLane(
                self.servicer,
                self.credentials,
                required=config.require_credential,
                max_frame_bytes=config.server.max_message_bytes,
                open_grpc=self.open_grpc,
            )
            await self.lane.start(config.lane)
        if server.opened:
            self._bound(server)
        if config.ready_fd is not None:
            # SERVING before the starter hears of it (run_service's own call is then a no-op).
            await server.set_serving()
            serving = server.addresses if server.opened else [config.lane or ""]
            _report_ready(config.ready_fd, serving)

    async def open_grpc(self) -> list[str]:
        """Start the gRPC server of an agent started with it on demand (the lane's
        ``open_grpc``); its addresses once it serves."""
        server = self.server
        if server is None:
            raise RuntimeError("the agent has not started")
        if server.opened:
            return server.addresses
        try:
            addresses = await server.open()
        except (OSError, RuntimeError) as exc:  # cannot bind; or the agent is stopping
            raise OrchardError(
                Reason.UNAVAILABLE, f"the agent cannot start its gRPC server: {exc}"
            ) from None
        # Concurrent callers all get here; the configuration is read again after the await, so
        # only the first closes the directory (a second close could hit a reused descriptor).
        self._bound(server)
        return addresses

    def _bound(self, server: GrpcServer) -> None:
        """Once gRPC has bound: let go of the listen directory, write the address file."""
        config = self.config
        assert config is not None
        if config.listen_dir_fd is not None:
            # The handle on a directory outside the root must not outlive the binding.
            self.config = dataclasses.replace(config, listen_dir_fd=None)
            with contextlib.suppress(OSError):
                os.close(config.listen_dir_fd)
        if config.address_file:
            _write_address_file(config.address_file, server.addresses)

    async def on_stop(self, config: AgentConfig, server: GrpcServer) -> None:
        if self.lane is not None:
            await self.lane.close()
        if self.supervisor is not None:
            self.supervisor.close()
        if config.address_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(config.address_file)


def _write_address_file(path: str, addresses: Sequence[str]) -> None:
    temp = f"{path}.tmp{os.getpid()}"
    with open(temp, "w", encoding="utf-8") as file:
        file.write("".join(f"{address}\n" for address in addresses))
    os.replace(temp, path)


def _report_ready(fd: int, addresses: Sequence[str]) -> None:
    data = "".join(f"{address}\n" for address in addresses).encode()
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError as exc:  # the starter went away: nobody to tell, keep serving
        log.warning("cannot report readiness on fd %d: %s", fd, exc)
    finally:
        os.close(fd)


def _make_non_dumpable() -> None:
    """As PID 1 of a sandbox, or holding a key: out of reach of a command's ptrace and of
    /proc/PID/{environ,mem,fd} (without CAP_SYS_PTRACE).

    The sandbox's setup sets this before an exec of the agent, which resets it; commands are
    dumpable again after their own exec, so only the agent is protected.
    """
    import ctypes  # noqa: PLC0415 - once, at start

    pr_set_dumpable = 4
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_dumpable, 0, 0, 0, 0) != 0:
        log.warning("cannot make the agent non-dumpable: errno %d", ctypes.get_errno())


def _take_identity_key() -> bytes | None:
    """The sandbox key from the environment, removed from it: commands never inherit it (they
    start from a filtered environment anyway), and the agent keeps it in memory only."""
    key = os.environ.pop(KEY_VARIABLE, "")
    return key.encode() if key else None


def run(argv: Sequence[str] | None = None) -> int:
    """Run the agent with ``argv`` (default: the process's arguments); return the exit status."""
    identity_key = _take_identity_key()
    sandbox_id = os.environ.pop(SANDBOX_ID_VARIABLE, "") or None
    if os.getpid() == 1 or identity_key is not None:
        # Also out of PID 1: /proc/PID/environ still shows the key the agent was started with.
        _make_non_dumpable()
    agent = _Agent(identity_key, sandbox_id)
    return run_service(
        "inagent",
        load_agent_config,
        agent.bindings,
        argv=argv,
        description="The Orchard sandbox agent: exec, files and health over gRPC.",
        flags=AGENT_FLAGS,
        interceptors=(agent.interceptor,),
        on_start=agent.on_start,
        on_stop=agent.on_stop,
        deferred=lambda config: config.grpc_on_demand,
    )


def main() -> None:
    """Console entry point of ``orchard-inagent``."""
    sys.exit(run())


if __name__ == "__main__":
    main()
