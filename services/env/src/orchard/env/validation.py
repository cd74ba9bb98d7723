"""Checks of client input: each failure is INVALID_ARGUMENT naming the field it is about."""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping

from orchard.core.errors import OrchardError, Reason
from orchard.env.config import LimitsConfig
from orchard.env.v1 import env_pb2

__all__ = ["heartbeat_timeout_s", "invalid", "validate_labels", "validate_spec"]

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


def validate_labels(labels: Mapping[str, str], field: str = "spec.labels") -> None:
    for key, value in labels.items():
        if not _LABEL_KEY.match(key):
            raise invalid(f"{field}[{key!r}]", "keys are 1-63 characters of [a-z0-9._/-]")
        if len(value) > 63:
            raise invalid(f"{field}[{key!r}]", "values are at most 63 characters")


def heartbeat_timeout_s(spec: env_pb2.SandboxSpec, limits: LimitsConfig) -> int:
    """The lease TTL in whole seconds (rounded up), checked against the service bounds."""
    if not spec.HasField("heartbeat_timeout"):
        return math.ceil(limits.default_heartbeat_timeout_s)
    timeout = spec.heartbeat_timeout
    if timeout.seconds < 0 or timeout.nanos < 0:
        raise invalid("spec.heartbeat_timeout", "must be positive")
    seconds = timeout.seconds + timeout.nanos / 1e9
    if seconds < limits.min_heartbeat_timeout_s or seconds > limits.max_heartbeat_timeout_s:
        raise invalid(
            "spec.heartbeat_timeout",
            f"{seconds:g} s is outside {limits.min_heartbeat_timeout_s:g}-"
            f"{limits.max_heartbeat_timeout_s:g} s",
        )
    return math.ceil(seconds)


def _validate_resources(spec: env_pb2.SandboxSpec, limits: LimitsConfig) -> None:
    bounds = {
        "cpu_millis": limits.max_cpu_millis,
        "memory_bytes": limits.max_memory_bytes,
        "pids": limits.max_pids,
        "disk_bytes": limits.max_disk_bytes,
    }
    for name, most in bounds.items():
        value = getattr(spec.resources, name)
        if value < 0:
            raise invalid(f"spec.resources.{name}", f"must not be negative, got {value}")
        if value > most:
            raise invalid(f"spec.resources.{name}", f"{value} is above the service maximum {most}")


def validate_egress(policy: env_pb2.NetworkPolicy, field: str) -> None:
    for i, rule in enumerate(policy.egress):
        where = f"{field}.egress[{i}]"
        destination = rule.destination
        if not destination:
            raise invalid(f"{where}.destination", "required")
        try:
            ipaddress.ip_network(destination, strict=False)
        except ValueError:
            if not _HOSTNAME.match(destination):
                raise invalid(
                    f"{where}.destination", f"{destination!r} is not a host name, IP or CIDR"
                ) from None
        for port in rule.ports:
            if not 1 <= port <= 65535:
                raise invalid(f"{where}.ports", f"{port} is not a port (1-65535)")


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
