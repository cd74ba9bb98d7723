"""The runtime interface: what the environment service needs from a place that runs sandboxes.

The service owns records, leases, tenants and the API; a runtime owns processes, mounts,
cgroups, network namespaces or Pods. The service never reaches into a runtime's resources
except through this interface, and one conformance suite (``services/env/tests/conformance``)
runs against every implementation.

Identity: the service assigns ``sandbox_id``; a runtime names every resource it creates after
it, so that :meth:`Runtime.list_sandboxes` can find leftovers after a crash.

Exec and file calls never go through the runtime: the service dials
:attr:`RuntimeSandbox.agent_address` (the sandbox's ``orchard-inagent``) directly.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchard.env.images.trust import ImageTrust

__all__ = [
    "AgentUnreachable",
    "EgressRule",
    "FailureReason",
    "Runtime",
    "RuntimeFailure",
    "RuntimeNotSupported",
    "RuntimeResources",
    "RuntimeSandbox",
    "RuntimeSandboxSpec",
    "RuntimeUnavailable",
    "SandboxExit",
    "SandboxStatus",
]


class FailureReason(enum.Enum):
    """Why a sandbox could not start or stopped running; the value is the record's reason."""

    IMAGE_NOT_FOUND = "IMAGE_NOT_FOUND"
    IMAGE_INVALID = "IMAGE_INVALID"
    IMAGE_NOT_ALLOWED = "IMAGE_NOT_ALLOWED"
    AGENT_START_TIMEOUT = "AGENT_START_TIMEOUT"
    AGENT_EXITED = "AGENT_EXITED"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    RUNTIME_DIED = "RUNTIME_DIED"
    RESOURCES_UNAVAILABLE = "RESOURCES_UNAVAILABLE"
    EVICTED = "EVICTED"
    PREEMPTED = "PREEMPTED"
    INTERNAL = "INTERNAL"


class RuntimeFailure(Exception):
    """A sandbox operation failed for a reason the record can carry."""

    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class RuntimeNotSupported(Exception):
    """This runtime cannot do what was asked (yet), e.g. egress rules or fork; the service
    answers UNIMPLEMENTED (or FAILED_PRECONDITION) with the message, and nothing changed."""


class AgentUnreachable(Exception):
    """:meth:`Runtime.verify_agent` could not tell: the agent, or what the runtime needs to
    judge it (its API server), did not answer. Nothing is sent to the agent; the caller gets
    UNAVAILABLE and the next call checks again."""


class RuntimeUnavailable(Exception):
    """The runtime cannot run on this host; the message says what is missing and how to fix it."""


@dataclass(frozen=True)
class RuntimeResources:
    """Limits of one sandbox; zero means the runtime's default."""

    cpu_millis: int = 0
    memory_bytes: int = 0
    pids: int = 0
    disk_bytes: int = 0


@dataclass(frozen=True)
class EgressRule:
    """One allowed destination: a host name, an IP or a CIDR, optional ports, an expiry; or
    another sandbox of the same runtime (``peer``), resolved by the service to its address
    and the ports it accepts on."""

    destination: str
    ports: tuple[int, ...] = ()
    protocol: str = ""  # "", "tcp" or "udp"
    expire_unix_s: float | None = None
    peer: str = ""
    """The id of the sandbox this rule reaches; ``destination`` is then its
    ``network_address`` and ``ports`` some of its ingress ports (never empty)."""


@dataclass(frozen=True)
class RuntimeSandboxSpec:
    """What the runtime needs to start one sandbox."""

    sandbox_id: str
    image: str
    resources: RuntimeResources = field(default_factory=RuntimeResources)
    env: Mapping[str, str] = field(default_factory=dict)
    working_dir: str = "/"
    egress: Sequence[EgressRule] = ()
    ingress_ports: tuple[int, ...] = ()
    """Ports on which sandboxes with a peer rule naming this one may connect to it; any gives it
    an address (``RuntimeSandbox.network_address``)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    owner: str = ""
    """The owner (EnvService.CreateOwner) whose lease keeps the sandbox alive; empty: the sandbox
    has its own lease. Runtimes may record it (the kubernetes runtime labels the Pod with it)."""
    raw_sockets: bool = False
    """Commands keep CAP_NET_RAW (raw and packet sockets); off by default."""
    user_namespaces: bool = False
    """Commands may create user namespaces; off by default."""
    image_trust: ImageTrust | None = None
    """What the image may name on the host (the operator's ``images`` settings for the
    sandbox's tenant); None: the caller is the operator (any path the runtime does not
    protect, and the host image)."""
    agent_grpc_on_demand: bool = False
    """The caller opens the agent's gRPC server over its exec lane (the lane's ``open_grpc``)
    before its first gRPC call, so the agent may start with the lane alone: a sandbox that
    only runs commands then costs no gRPC server. Runtimes that give agents no lane ignore it
    (their agents serve gRPC from the start)."""


@dataclass(frozen=True)
class RuntimeSandbox:
    """A started sandbox whose agent is serving."""

    sandbox_id: str
    agent_address: str  # a gRPC target: "unix:/path" locally, "10.1.2.3:7070" on Kubernetes
    agent_version: str = ""
    network_address: str = ""  # where peers reach it; "" unless the spec has ingress ports
    lane_address: str = ""
    """The agent's exec lane (``unix:/path``; :mod:`orchard.inagent.exec_lane`), where it
    serves orchard-env's Exec calls in a lean framing; "" when it has none (gRPC only)."""


class SandboxStatus(enum.Enum):
    """What the runtime knows of a sandbox."""

    RUNNING = "RUNNING"
    EXITED = "EXITED"  # resources may remain until delete()
    ABSENT = "ABSENT"  # nothing of it exists


@dataclass(frozen=True)
class SandboxExit:
    """A sandbox stopped running without being deleted."""

    sandbox_id: str
    reason: FailureReason
    message: str


class Runtime(abc.ABC):
    """Runs sandboxes. Implementations must be safe to call concurrently for different ids."""

    name: str

    @abc.abstractmethod
    async def start(self) -> None:
        """Check prerequisites and prepare; raise :class:`RuntimeUnavailable` when the host
        cannot run this runtime (e.g. not root, no usable cgroup controllers)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop watching; leaves sandboxes running (they outlive a service restart)."""

    @abc.abstractmethod
    async def create(self, spec: RuntimeSandboxSpec) -> RuntimeSandbox:
        """Start a sandbox and return once its agent is serving.

        Raises :class:`RuntimeFailure` with a reason; on failure nothing of the sandbox remains.
        Cancelling the call releases whatever was created.
        """

    @abc.abstractmethod
    async def fork(self, source_id: str, spec: RuntimeSandboxSpec) -> RuntimeSandbox:
        """Start a new sandbox from a copy of ``source_id``'s file system state."""

    @abc.abstractmethod
    async def delete(self, sandbox_id: str) -> None:
        """Kill every process and release every resource of the sandbox. Idempotent."""

    @abc.abstractmethod
    async def status(self, sandbox_id: str) -> SandboxStatus:
        """What the runtime knows of the sandbox now."""

    @abc.abstractmethod
    async def list_sandboxes(self) -> list[str]:
        """Ids of every sandbox that has any resource in this runtime (for reconciliation)."""

    @abc.abstractmethod
    async def update_egress(self, sandbox_id: str, egress: Sequence[EgressRule]) -> None:
        """Replace the sandbox's allowed destinations; everything else stays denied."""

    @abc.abstractmethod
    def exits(self) -> AsyncIterator[SandboxExit]:
        """Events: sandboxes that stopped running without being deleted (agent exit, OOM)."""

    def private_paths(self) -> Sequence[str]:
        """Host paths holding this runtime's own state (other sandboxes' files, sockets,
        unpacked images): never an image source, hidden from ``host`` sandboxes."""
        return ()

    async def verify_agent(self, sandbox_id: str, address: str) -> bool:
        """Whether whatever serves at ``address`` is the agent this runtime started for the
        sandbox; checked before the service first talks to it (also after a restart). False
        means an impostor: the service sends it nothing. Raises :class:`AgentUnreachable` when
        it cannot tell now. A runtime where nothing else can serve at the address answers
        True; the local runtime compares the socket's peer with the sandbox's PID 1, the
        kubernetes runtime asks the agent to prove it holds the sandbox's key."""
        return True

    async def agent_key(self, sandbox_id: str) -> bytes | None:
        """The key this runtime gave the sandbox's agent (its ``ORCHARD_AGENT_KEY``), with
        which the service signs route credentials that the agent checks by itself
        (``EnvService.OpenAgentRoute``); None: its agents hold no key, so no direct route.
        Raises :class:`AgentUnreachable` when it cannot be read now."""
        return None

    async def adopt(self, sandbox_id: str) -> None:
        """Report this sandbox's exit through :meth:`exits` from now on, though another
        process started it (a replica that died); a no-op where every runtime client already
        sees every exit (e.g. one Pod watch). Idempotent; an absent sandbox is ignored."""
        return None
