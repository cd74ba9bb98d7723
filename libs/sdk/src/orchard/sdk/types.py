"""Plain, typed values the client returns: sandboxes, command results, stream events, files.

They are frozen dataclasses built from the protobuf messages, so callers never touch generated
code. Times are timezone-aware ``datetime`` values, durations are seconds as ``float``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from google.protobuf import duration_pb2, timestamp_pb2

from orchard.env.v1 import env_pb2
from orchard.sdk.errors import CommandFailed
from orchard.types.v1 import exec_pb2, files_pb2, resources_pb2

__all__ = [
    "EgressRule",
    "ExecEvent",
    "ExecExit",
    "ExecResult",
    "ExecStarted",
    "ExecStderr",
    "ExecStdout",
    "FileInfo",
    "FileType",
    "Resources",
    "SandboxInfo",
    "SandboxState",
]


class SandboxState(enum.Enum):
    """Where a sandbox is in its life."""

    UNSPECIFIED = "UNSPECIFIED"
    PENDING = "PENDING"
    READY = "READY"
    FAILED = "FAILED"
    DELETING = "DELETING"

    @classmethod
    def from_proto(cls, value: int) -> SandboxState:
        name = env_pb2.SandboxState.Name(value).removeprefix("SANDBOX_STATE_")  # type: ignore[arg-type]
        return cls(name)

    def to_proto(self) -> env_pb2.SandboxState.ValueType:
        return env_pb2.SandboxState.Value(f"SANDBOX_STATE_{self.value}")


@dataclass(frozen=True)
class Resources:
    """Limits of a sandbox; zero (the default) means the service's default.

    ``Resources(cpus=1.5, memory="512M")`` is the same as
    ``Resources(cpu_millis=1500, memory_bytes=512 * 2**20)``.
    """

    cpu_millis: int = 0
    """CPU limit in thousandths of a core."""
    memory_bytes: int = 0
    """Memory limit in bytes; going over it kills processes in the sandbox."""
    pids: int = 0
    """Most processes and threads alive at once."""
    disk_bytes: int = 0
    """Most bytes the sandbox's writable layer may hold."""

    @classmethod
    def of(
        cls,
        *,
        cpus: float | None = None,
        memory: int | str | None = None,
        pids: int | None = None,
        disk: int | str | None = None,
    ) -> Resources:
        """Resources from friendly units: ``cpus=0.5``, ``memory="512M"``, ``disk="2G"``."""
        from orchard.sdk.units import parse_size  # noqa: PLC0415

        return cls(
            cpu_millis=round(cpus * 1000) if cpus else 0,
            memory_bytes=parse_size(memory) if memory is not None else 0,
            pids=pids or 0,
            disk_bytes=parse_size(disk) if disk is not None else 0,
        )

    def to_proto(self) -> resources_pb2.Resources:
        return resources_pb2.Resources(
            cpu_millis=self.cpu_millis,
            memory_bytes=self.memory_bytes,
            pids=self.pids,
            disk_bytes=self.disk_bytes,
        )

    @classmethod
    def from_proto(cls, message: resources_pb2.Resources) -> Resources:
        return cls(message.cpu_millis, message.memory_bytes, message.pids, message.disk_bytes)


@dataclass(frozen=True)
class EgressRule:
    """One destination a sandbox may open connections to; everything else stays denied.

    ``destination``: a host name, an IP, a CIDR block, or ``EgressRule.to_sandbox(id)``:
    another sandbox of the caller's, which must accept on the ports (its ``ingress_ports``).
    ``ports`` empty: every port (of that sandbox: every port it accepts on). ``protocol``
    "": TCP and UDP. ``expire_at``: a Unix time when the allowance ends; None: the sandbox's
    life.
    """

    destination: str
    ports: tuple[int, ...] = ()
    protocol: Literal["", "tcp", "udp"] = ""
    expire_at: float | None = None

    @classmethod
    def to_sandbox(cls, sandbox_id: str, *ports: int, expire_at: float | None = None) -> EgressRule:
        """An allowance to reach another sandbox (see ``NetworkPolicy.ingress_ports``)."""
        return cls(f"sandbox:{sandbox_id}", tuple(ports), "", expire_at)

    def to_proto(self) -> env_pb2.EgressRule:
        protocols = {"": env_pb2.PROTOCOL_UNSPECIFIED, "tcp": env_pb2.PROTOCOL_TCP}
        message = env_pb2.EgressRule(
            destination=self.destination,
            ports=self.ports,
            protocol=protocols.get(self.protocol, env_pb2.PROTOCOL_UDP),
        )
        if self.expire_at is not None:
            message.expire_time.FromNanoseconds(int(self.expire_at * 1e9))
        return message

    @classmethod
    def from_proto(cls, message: env_pb2.EgressRule) -> EgressRule:
        names: dict[int, Literal["", "tcp", "udp"]] = {
            env_pb2.PROTOCOL_TCP: "tcp",
            env_pb2.PROTOCOL_UDP: "udp",
        }
        return cls(
            message.destination,
            tuple(message.ports),
            names.get(message.protocol, ""),
            message.expire_time.ToNanoseconds() / 1e9 if message.HasField("expire_time") else None,
        )


@dataclass(frozen=True)
class SandboxInfo:
    """A snapshot of one sandbox as the service last described it."""

    id: str
    state: SandboxState
    image: str
    labels: Mapping[str, str] = field(default_factory=dict)
    resources: Resources = field(default_factory=Resources)
    env: Mapping[str, str] = field(default_factory=dict)
    working_dir: str = ""
    heartbeat_timeout: float | None = None
    """Seconds without a heartbeat before it is reaped, as asked for; None = service default."""
    tenant: str = ""
    runtime: str = ""
    failure_reason: str = ""
    failure_message: str = ""
    create_time: datetime | None = None
    ready_time: datetime | None = None
    expire_time: datetime | None = None
    agent_version: str = ""
    queue_position: int = 0
    owner_id: str = ""
    forked_from: str = ""
    egress: tuple[EgressRule, ...] = ()
    """What it may reach (its network policy's rules)."""
    ingress_ports: tuple[int, ...] = ()
    """Ports on which sandboxes allowed to reach it (``EgressRule.to_sandbox``) connect."""
    network_address: str = ""
    """Where such sandboxes reach it; "" when it has no ``ingress_ports``."""

    @classmethod
    def from_proto(cls, message: env_pb2.Sandbox) -> SandboxInfo:
        spec = message.spec
        return cls(
            id=message.id,
            state=SandboxState.from_proto(message.state),
            image=spec.image,
            labels=dict(spec.labels),
            resources=Resources.from_proto(spec.resources),
            env=dict(spec.env),
            working_dir=spec.working_dir,
            heartbeat_timeout=(
                seconds(spec.heartbeat_timeout) if spec.HasField("heartbeat_timeout") else None
            ),
            tenant=message.tenant,
            runtime=message.runtime,
            failure_reason=message.failure.reason,
            failure_message=message.failure.message,
            create_time=_time(message, "create_time"),
            ready_time=_time(message, "ready_time"),
            expire_time=_time(message, "expire_time"),
            agent_version=message.agent_version,
            queue_position=message.queue_position,
            owner_id=spec.owner_id,
            forked_from=message.forked_from,
            egress=tuple(EgressRule.from_proto(r) for r in spec.network_policy.egress),
            ingress_ports=tuple(spec.network_policy.ingress_ports),
            network_address=message.network_address,
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (times as RFC 3339 strings), as ``orchard sandbox ls --json``
        prints it."""
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, Resources):
                value = {k: getattr(value, k) for k in value.__dataclass_fields__}
            elif isinstance(value, Mapping):
                value = dict(value)
            out[name] = value
        return out


@dataclass(frozen=True)
class ExecResult:
    """How a command ended and what it wrote.

    ``exit_code`` is set when the command exited by itself, ``signal`` when a signal ended it
    (e.g. 9 after a timeout kill). Output is raw bytes; ``stdout_text``/``stderr_text`` decode
    it as UTF-8 with replacement::

        result = sandbox.exec(["python3", "-c", "print(6 * 7)"])
        assert result.check().stdout_text == "42\\n"
    """

    exit_code: int | None
    signal: int | None = None
    timed_out: bool = False
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_bytes: int = 0
    """Total bytes written to stdout, including bytes dropped past the cap."""
    stderr_bytes: int = 0
    """Total bytes written to stderr, including bytes dropped past the cap."""
    duration: float = 0.0
    """Wall-clock seconds from start to exit."""
    command: str = field(default="", compare=False)
    """The command as a person reads it, for error messages."""

    @property
    def ok(self) -> bool:
        """True when the command exited with status 0 within its timeout."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", "replace")

    def check(self) -> ExecResult:
        """Return self when :attr:`ok`, else raise :class:`~orchard.sdk.errors.CommandFailed`."""
        if not self.ok:
            raise CommandFailed(self, self.command)
        return self

    @classmethod
    def from_proto(cls, message: exec_pb2.ExecResult, command: str = "") -> ExecResult:
        exit_ = ExecExit.from_proto(message.status)
        return cls(
            exit_code=exit_.exit_code,
            signal=exit_.signal,
            timed_out=exit_.timed_out,
            stdout=message.stdout,
            stderr=message.stderr,
            stdout_truncated=exit_.stdout_truncated,
            stderr_truncated=exit_.stderr_truncated,
            stdout_bytes=exit_.stdout_bytes,
            stderr_bytes=exit_.stderr_bytes,
            duration=exit_.duration,
            command=command,
        )


@dataclass(frozen=True)
class ExecStarted:
    """The command started; always the first event of a stream."""

    pid: int
    kind: Literal["started"] = "started"


@dataclass(frozen=True)
class ExecStdout:
    """A chunk of standard output, as the command wrote it."""

    data: bytes
    kind: Literal["stdout"] = "stdout"


@dataclass(frozen=True)
class ExecStderr:
    """A chunk of standard error, as the command wrote it."""

    data: bytes
    kind: Literal["stderr"] = "stderr"


@dataclass(frozen=True)
class ExecExit:
    """The command ended; always the last event of a stream."""

    exit_code: int | None
    signal: int | None = None
    timed_out: bool = False
    duration: float = 0.0
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    kind: Literal["exit"] = "exit"

    @classmethod
    def from_proto(cls, status: exec_pb2.ExitStatus) -> ExecExit:
        termination = status.WhichOneof("termination")
        return cls(
            exit_code=status.exit_code if termination == "exit_code" else None,
            signal=status.signal if termination == "signal" else None,
            timed_out=status.timed_out,
            duration=seconds(status.duration),
            stdout_bytes=status.stdout_bytes,
            stderr_bytes=status.stderr_bytes,
            stdout_truncated=status.stdout_truncated,
            stderr_truncated=status.stderr_truncated,
        )


ExecEvent = ExecStarted | ExecStdout | ExecStderr | ExecExit
"""One event of :meth:`Sandbox.exec_stream`; match on the class or on ``.kind``."""


def exec_event_from_proto(event: exec_pb2.ExecEvent) -> ExecEvent | None:
    """The typed event, or None for an event this version does not know."""
    which = event.WhichOneof("event")
    if which == "started":
        return ExecStarted(pid=event.started.pid)
    if which == "stdout":
        return ExecStdout(event.stdout)
    if which == "stderr":
        return ExecStderr(event.stderr)
    if which == "exit":
        return ExecExit.from_proto(event.exit)
    return None


class FileType(enum.Enum):
    """The kind of a file system entry."""

    UNSPECIFIED = "UNSPECIFIED"
    REGULAR = "REGULAR"
    DIRECTORY = "DIRECTORY"
    SYMLINK = "SYMLINK"
    OTHER = "OTHER"


@dataclass(frozen=True)
class FileInfo:
    """One entry of a sandbox's file system."""

    path: str
    name: str
    type: FileType
    size: int
    mode: int
    """Permission bits, e.g. ``0o644``."""
    modify_time: datetime | None = None
    symlink_target: str = ""

    @property
    def is_dir(self) -> bool:
        return self.type is FileType.DIRECTORY

    @classmethod
    def from_proto(cls, message: files_pb2.FileInfo) -> FileInfo:
        kind = files_pb2.FileType.Name(message.type).removeprefix("FILE_TYPE_")
        return cls(
            path=message.path,
            name=message.name,
            type=FileType(kind),
            size=message.size,
            mode=message.mode,
            modify_time=_time(message, "modify_time"),
            symlink_target=message.symlink_target,
        )


def seconds(duration: duration_pb2.Duration) -> float:
    """A protobuf Duration as float seconds."""
    return duration.seconds + duration.nanos / 1e9


def duration(value: float) -> duration_pb2.Duration:
    """Float seconds as a protobuf Duration."""
    message = duration_pb2.Duration()
    message.FromNanoseconds(round(value * 1e9))
    return message


def _time(message: Any, name: str) -> datetime | None:
    if not message.HasField(name):
        return None
    stamp: timestamp_pb2.Timestamp = getattr(message, name)
    return stamp.ToDatetime(tzinfo=UTC)
