"""Checks of client input: each failure is INVALID_ARGUMENT naming the field it is about."""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping, Sequence

from orchard.core.errors import OrchardError, Reason
from orchard.env.config import ImagesConfig, LimitsConfig
from orchard.env.images.reference import parse_image_reference
from orchard.env.images.trust import ImageNotAllowed, ImageTrust, check_image
from orchard.env.reasons import EnvReason
from orchard.env.runtime.base import RuntimeFailure
from orchard.env.v1 import env_pb2

__all__ = ["ImagePolicy", "heartbeat_timeout_s", "invalid", "validate_labels", "validate_spec"]

_LABEL_KEY = re.compile(r"^[a-z0-9._/-]{1,63}$")
_ENV_NAME = re.compile(r"^[^=\x00]+$")
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)([a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)"
    r"(\.[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)*\.?$"
)
# A registry reference: [host[:port]/]path[:tag][@digest], lowercase path components.
_REFERENCE = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._-]+[a-z0-9]+)*"
    r"(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@sha256:[0-9a-f]{64})?$"
)
_PATH_IMAGES = ("rootfs:", "oci-archive:", "docker-archive:")
PEER_PREFIX = "sandbox:"  # an egress destination naming another sandbox (orchard.env.peers)
_PEER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_INGRESS_PORTS = 64


def invalid(field: str, problem: str) -> OrchardError:
    """INVALID_ARGUMENT about one field; the field is in the message and the metadata."""
    return OrchardError(Reason.INVALID_ARGUMENT, f"{field}: {problem}", metadata={"field": field})


def validate_image(image: str, field: str = "spec.image") -> None:
    if not image:
        raise invalid(field, "required (`host`, `rootfs:/dir`, `oci-archive:/file.tar`, ...)")
    if image == "host":
        return
    for prefix in _PATH_IMAGES:
        if image.startswith(prefix):
            path = image[len(prefix) :]
            if not path.startswith("/") or "\x00" in path:
                raise invalid(field, f"{prefix} needs an absolute path, got {path!r}")
            return
    if len(image) > 512 or not _REFERENCE.match(image):
        raise invalid(
            field,
            f"{image!r} is neither `host`, `rootfs:/dir`, `oci-archive:/file.tar`, "
            "`docker-archive:/file.tar` nor a registry reference",
        )


class ImagePolicy:
    """The operator's ``images`` settings applied to one tenant's image: the host image and
    host paths are PERMISSION_DENIED unless allowed. ``protected`` are the runtime's own
    directories (never an image source), ``service_paths`` the service's own files (the
    secrets key): masked in host sandboxes like ``images.host_masked_paths``."""

    def __init__(
        self, config: ImagesConfig, protected: Sequence[str], service_paths: Sequence[str] = ()
    ) -> None:
        self.config = config
        self.protected = tuple(protected)
        self.masked = (*config.host_masked_paths, *service_paths)

    def trust(self, tenant: str) -> ImageTrust:
        return ImageTrust(
            tenant=tenant,
            allow_host=self.config.host_allowed(tenant),
            allowed_paths=self.config.paths_allowed(tenant),
            host_masked_paths=self.masked,
        )

    def check(self, tenant: str, image: str, field: str = "spec.image") -> None:
        """Raise PERMISSION_DENIED (IMAGE_NOT_ALLOWED) for an image ``tenant`` may not use.
        The runtime checks again on the real path when it creates the sandbox."""
        if image != "host" and not image.startswith(_PATH_IMAGES):
            return  # a registry reference names no host path
        try:
            check_image(parse_image_reference(image), self.trust(tenant), self.protected)
        except ImageNotAllowed as exc:
            raise OrchardError(
                EnvReason.IMAGE_NOT_ALLOWED, exc.message, metadata={"field": field}
            ) from None
        except RuntimeFailure as exc:
            raise invalid(field, exc.message) from None


def validate_labels(labels: Mapping[str, str], field: str = "spec.labels") -> None:
    for key, value in labels.items():
        if not _LABEL_KEY.match(key):
            raise invalid(f"{field}[{key!r}]", "keys are 1-63 characters of [a-z0-9._/-]")
        if len(value) > 63:
            raise invalid(f"{field}[{key!r}]", "values are at most 63 characters")


# The ranges of google.protobuf.Duration and Timestamp: outside them a message is still sent on
# the wire, but cannot be written as JSON (how records are stored).
MAX_NANOS = 999_999_999
MIN_TIMESTAMP_S = -62_135_596_800  # 0001-01-01T00:00:00Z
MAX_TIMESTAMP_S = 253_402_300_799  # 9999-12-31T23:59:59Z


def heartbeat_timeout_s(spec: env_pb2.SandboxSpec, limits: LimitsConfig) -> int:
    """The lease TTL in whole seconds (rounded up), checked against the service bounds."""
    if not spec.HasField("heartbeat_timeout"):
        return math.ceil(limits.default_heartbeat_timeout_s)
    timeout = spec.heartbeat_timeout
    if timeout.seconds < 0 or timeout.nanos < 0:
        raise invalid("spec.heartbeat_timeout", "must be positive")
    if timeout.nanos > MAX_NANOS:
        # Not a Duration protobuf can store as JSON: the record could not be written.
        raise invalid("spec.heartbeat_timeout", f"nanos must be 0-{MAX_NANOS}, got {timeout.nanos}")
    seconds = timeout.seconds + timeout.nanos / 1e9
    if seconds < limits.min_heartbeat_timeout_s or seconds > limits.max_heartbeat_timeout_s:
        raise invalid(
            "spec.heartbeat_timeout",
            f"{seconds:g} s is outside {limits.min_heartbeat_timeout_s:g}-"
            f"{limits.max_heartbeat_timeout_s:g} s",
        )
    return math.ceil(seconds)


# The least a sandbox can start and run a command with (0 still means the service default):
# the agent alone takes ~30 MiB and 8 tasks when executed from its bundle, and a layer file
# system needs room for its own metadata; the kernel refuses a CPU quota under 1 ms per period
# (cgroup v1 `cpu.cfs_quota_us`, v2 `cpu.max`), which is 10 millicores of the 100 ms period the
# local runtime uses. Below these a start fails in ways that read as bugs.
MIN_RESOURCES = {
    "cpu_millis": 10,
    "memory_bytes": 32 * 1024**2,
    "pids": 16,
    "disk_bytes": 16 * 1024**2,
}


def _validate_resources(spec: env_pb2.SandboxSpec, limits: LimitsConfig) -> None:
    bounds = {
        "cpu_millis": limits.max_cpu_millis,
        "memory_bytes": limits.max_memory_bytes,
        "pids": limits.max_pids,
        "disk_bytes": limits.max_disk_bytes,
    }
    for name, most in bounds.items():
        value = getattr(spec.resources, name)
        least = MIN_RESOURCES[name]
        if value < 0:
            raise invalid(f"spec.resources.{name}", f"must not be negative, got {value}")
        if value > most:
            raise invalid(f"spec.resources.{name}", f"{value} is above the service maximum {most}")
        if 0 < value < least:
            raise invalid(
                f"spec.resources.{name}",
                f"{value} is below the {least} a sandbox needs to start (0: the default)",
            )


def validate_egress(policy: env_pb2.NetworkPolicy, field: str) -> None:
    for i, rule in enumerate(policy.egress):
        where = f"{field}.egress[{i}]"
        destination = rule.destination
        if not destination:
            raise invalid(f"{where}.destination", "required")
        if destination.startswith(PEER_PREFIX):
            peer = destination[len(PEER_PREFIX) :]
            if not _PEER_ID.fullmatch(peer):
                raise invalid(f"{where}.destination", f"{destination[:80]!r} names no sandbox id")
        else:
            try:
                ipaddress.ip_network(destination, strict=False)
            except ValueError:
                if not _HOSTNAME.match(destination):
                    raise invalid(
                        f"{where}.destination",
                        f"{destination!r} is not a host name, IP, CIDR or sandbox:<id>",
                    ) from None
        for port in rule.ports:
            if not 1 <= port <= 65535:
                raise invalid(f"{where}.ports", f"{port} is not a port (1-65535)")
        stamp = rule.expire_time
        if rule.HasField("expire_time") and not (
            MIN_TIMESTAMP_S <= stamp.seconds <= MAX_TIMESTAMP_S and 0 <= stamp.nanos <= MAX_NANOS
        ):
            raise invalid(
                f"{where}.expire_time",
                f"({stamp.seconds} s, {stamp.nanos} ns) is not a timestamp of the years 1-9999",
            )
    ports = list(policy.ingress_ports)
    for port in ports:
        if not 1 <= port <= 65535:
            raise invalid(f"{field}.ingress_ports", f"{port} is not a port (1-65535)")
    if len(set(ports)) != len(ports):
        raise invalid(f"{field}.ingress_ports", "each port at most once")
    if len(ports) > MAX_INGRESS_PORTS:
        raise invalid(f"{field}.ingress_ports", f"at most {MAX_INGRESS_PORTS} ports")


def validate_spec(spec: env_pb2.SandboxSpec, limits: LimitsConfig) -> int:
    """Check a spec; returns its heartbeat timeout (lease TTL) in seconds."""
    validate_image(spec.image)
    validate_labels(spec.labels)
    _validate_resources(spec, limits)
    validate_egress(spec.network_policy, "spec.network_policy")
    for name in spec.env:
        if not _ENV_NAME.match(name):
            raise invalid(f"spec.env[{name!r}]", "names must be non-empty, without '=' or NUL")
    if "\x00" in "".join(spec.env.values()):
        raise invalid("spec.env", "values must not contain NUL")
    if spec.working_dir and not spec.working_dir.startswith("/"):
        raise invalid("spec.working_dir", f"must be absolute, got {spec.working_dir!r}")
    return heartbeat_timeout_s(spec, limits)
