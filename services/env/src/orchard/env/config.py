"""Configuration of ``orchard-env``: one frozen pydantic model, validated at start.

Layers (lowest first): defaults, a YAML file (``--config`` or ``$ORCHARD_ENV_CONFIG``),
``ORCHARD_ENV_*`` variables, ``--set key=value``, flags.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from orchard.core.config import ConfigModel, ServerConfig, ServiceConfig

__all__ = [
    "AdmissionConfig",
    "AgentRouteConfig",
    "AuthConfig",
    "EnvConfig",
    "EtcdConfig",
    "ImagesConfig",
    "LimitsConfig",
    "PrivilegesConfig",
    "SecretsConfig",
    "TenantConfig",
    "TenantImagesConfig",
    "token_digest",
]

_TENANT_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
_SHA256_TOKEN = re.compile(r"^sha256:[0-9a-f]{64}$")


def token_digest(token: str) -> str:
    """How a token is stored in configuration: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


class EtcdConfig(ConfigModel):
    """Where sandbox records live."""

    endpoints: list[str] = Field(
        default_factory=list,
        description="etcd client URLs (http://HOST:PORT); required: `orchard up` starts one.",
    )
    prefix: str = Field(
        default="orchard/env/",
        description="Key prefix of every record; replicas that serve the same sandboxes share it.",
    )
    timeout_s: float = Field(default=5.0, gt=0, description="Deadline of one etcd call.")


class TenantConfig(ConfigModel):
    """One tenant and the bearer tokens that act as it."""

    tokens: list[str] = Field(
        default_factory=list,
        description=(
            "Accepted tokens: `sha256:<64 hex>` (the digest of the token; preferred) or the "
            "plain token (for local use)."
        ),
    )

    @field_validator("tokens")
    @classmethod
    def _tokens(cls, tokens: list[str]) -> list[str]:
        for token in tokens:
            if not token:
                raise ValueError("a token must not be empty")
            if token.startswith("sha256:") and not _SHA256_TOKEN.match(token):
                raise ValueError("a sha256: token needs 64 lowercase hex digits")
        return tokens


class AuthConfig(ConfigModel):
    """Tenants, found by the `authorization: Bearer <token>` metadata of every call."""

    tenants: dict[str, TenantConfig] = Field(
        default_factory=dict, description="Tenant name → its tokens."
    )
    anonymous_tenant: str | None = Field(
        default=None,
        description=(
            "Tenant of calls that carry no token (local single-user use). Unset: such calls "
            "are UNAUTHENTICATED."
        ),
    )

    @model_validator(mode="after")
    def _names(self) -> AuthConfig:
        names = list(self.tenants)
        if self.anonymous_tenant is not None:
            names.append(self.anonymous_tenant)
        for name in names:
            if not _TENANT_NAME.match(name):
                raise ValueError(
                    f"tenant name {name!r}: 1-63 of [a-z0-9._-], starting and ending alphanumeric"
                )
        seen: dict[str, str] = {}
        for name, tenant in self.tenants.items():
            for token in tenant.tokens:
                digest = token if _SHA256_TOKEN.match(token) else token_digest(token)
                if seen.setdefault(digest, name) != name:
                    raise ValueError(f"one token belongs to tenants {seen[digest]!r} and {name!r}")
        return self


class LimitsConfig(ConfigModel):
    """Bounds and defaults of what a sandbox may ask for."""

    default_heartbeat_timeout_s: float = Field(
        default=300.0, ge=1, description="Heartbeat timeout of a spec that sets none."
    )
    min_heartbeat_timeout_s: float = Field(
        default=1.0, ge=1, description="Shortest heartbeat timeout a spec may ask for."
    )
    max_heartbeat_timeout_s: float = Field(
        default=86_400.0, ge=1, description="Longest heartbeat timeout a spec may ask for."
    )
    default_cpu_millis: int = Field(default=1000, ge=0, description="CPU of a spec that sets 0.")
    default_memory_bytes: int = Field(
        default=2 * 1024**3, ge=0, description="Memory of a spec that sets 0."
    )
    default_pids: int = Field(
        default=1024, ge=0, description="Process limit of a spec that sets 0."
    )
    default_disk_bytes: int = Field(
        default=0,
        ge=0,
        description="Disk of a spec that sets 0; 0: the runtime's default (the local runtime: "
        "none). Set it where tenants are untrusted: the local runtime enforces a disk limit "
        "with a file system per sandbox, about 15-30 ms of CPU per create.",
    )
    max_cpu_millis: int = Field(default=64_000, ge=1, description="Most CPU one sandbox may ask.")
    max_memory_bytes: int = Field(
        default=256 * 1024**3, ge=1, description="Most memory one sandbox may ask."
    )
    max_pids: int = Field(
        default=1_000_000, ge=1, description="Most processes one sandbox may ask."
    )
    max_disk_bytes: int = Field(
        default=4 * 1024**4, ge=1, description="Most disk one sandbox may ask."
    )

    @model_validator(mode="after")
    def _order(self) -> LimitsConfig:
        low, default, high = (
            self.min_heartbeat_timeout_s,
            self.default_heartbeat_timeout_s,
            self.max_heartbeat_timeout_s,
        )
        if not low <= default <= high:
            raise ValueError(
                "heartbeat timeouts must satisfy min <= default <= max, "
                f"got {low} <= {default} <= {high}"
            )
        return self


class AdmissionConfig(ConfigModel):
    """How many sandboxes may be starting or running at once; the rest wait in a fair queue.

    Counted across every replica on one etcd prefix (one slot key per admitted sandbox). Unset
    limits do not apply; with none set there is no queue and creations start at once.
    """

    max_sandboxes: int | None = Field(
        default=None, ge=1, description="Admitted (starting or READY) sandboxes in all."
    )
    max_sandboxes_per_tenant: int | None = Field(
        default=None, ge=1, description="Admitted sandboxes of one tenant."
    )
    max_sandboxes_per_owner: int | None = Field(
        default=None, ge=1, description="Admitted sandboxes bound to one owner."
    )
    max_queued: int = Field(
        default=1000,
        ge=0,
        description="Sandboxes waiting for admission; beyond it CreateSandbox and ForkSandbox "
        "are RESOURCE_EXHAUSTED and create nothing.",
    )
    retry_after_s: float = Field(
        default=5.0, gt=0, description="The retry hint sent with a full queue's error."
    )

    @property
    def enabled(self) -> bool:
        return any(
            limit is not None
            for limit in (
                self.max_sandboxes,
                self.max_sandboxes_per_tenant,
                self.max_sandboxes_per_owner,
            )
        )


class PrivilegesConfig(ConfigModel):
    """Which tenants' sandboxes may give their commands more than the default privileges
    (``SandboxSpec.privileges``); any other tenant asking is PERMISSION_DENIED."""

    raw_sockets: list[str] = Field(
        default_factory=list,
        description="Tenants allowed `raw_sockets` (CAP_NET_RAW); `*` allows every tenant.",
    )
    user_namespaces: list[str] = Field(
        default_factory=list,
        description="Tenants allowed `user_namespaces`; `*` allows every tenant.",
    )

    def refused(self, tenant: str, raw_sockets: bool, user_namespaces: bool) -> list[str]:
        """The privileges asked for that ``tenant`` may not have (empty: all allowed)."""
        asked = {"raw_sockets": raw_sockets, "user_namespaces": user_namespaces}
        allowed = {"raw_sockets": self.raw_sockets, "user_namespaces": self.user_namespaces}
        return [
            name
            for name, wanted in asked.items()
            if wanted and tenant not in allowed[name] and "*" not in allowed[name]
        ]


# Never an image source, whatever the allow-list says: the whole host and the kernel's views.
_NEVER_IMAGE_SOURCES = ("/proc", "/sys", "/dev")


def _host_path(path: str, what: str) -> str:
    """``path`` checked absolute and without NUL, returned normalized."""
    if not os.path.isabs(path) or "\x00" in path:
        raise ValueError(f"{what}: {path!r} is not an absolute path")
    return os.path.normpath(path)


def _allowed_path(path: str, what: str) -> str:
    normal = _host_path(path, what)
    if normal == "/" or any(
        normal == never or normal.startswith(never + "/") for never in _NEVER_IMAGE_SOURCES
    ):
        raise ValueError(
            f"{what}: {normal!r} is the host's root or inside /proc, /sys or /dev, which are "
            "never image sources and never masked; name the directories themselves"
        )
    return normal


class TenantImagesConfig(ConfigModel):
    """What one tenant's images may name beyond the settings every tenant has."""

    allow_host: bool | None = Field(
        default=None,
        description="The `host` image for this tenant; unset: `images.allow_host`.",
    )
    allowed_paths: list[str] = Field(
        default_factory=list,
        description="Directories whose contents this tenant may name as `rootfs:`, "
        "`oci-archive:` or `docker-archive:` sources, on top of `images.allowed_paths`.",
    )

    @field_validator("allowed_paths")
    @classmethod
    def _paths(cls, paths: list[str]) -> list[str]:
        return [_allowed_path(path, "allowed_paths") for path in paths]


class ImagesConfig(ConfigModel):
    """Which images name host paths, and for whom: image sources on the host are the
    operator's choice, never a tenant's. Registry references are not limited here."""

    allow_host: bool = Field(
        default=False,
        description="The `host` image (the host's root, read-only, the service's own "
        "directories and `host_masked_paths` hidden) for every tenant.",
    )
    allowed_paths: list[str] = Field(
        default_factory=list,
        description="Directories whose contents every tenant may name as `rootfs:`, "
        "`oci-archive:` or `docker-archive:` sources, checked on the real path (symlinks and "
        "`..` resolved). Empty: no host path is an image source.",
    )
    host_masked_paths: list[str] = Field(
        default_factory=list,
        description="Host files and directories hidden in `host` sandboxes (an empty read-only "
        "tmpfs over a directory, /dev/null over a file) and never an image source: the "
        "service's state that is not the runtime's own (etcd data, tokens, logs, configs). "
        "The runtime's own directories are always hidden.",
    )
    tenants: dict[str, TenantImagesConfig] = Field(
        default_factory=dict, description="Per tenant: `allow_host`, more `allowed_paths`."
    )

    @field_validator("allowed_paths")
    @classmethod
    def _allowed(cls, paths: list[str]) -> list[str]:
        return [_allowed_path(path, "images.allowed_paths") for path in paths]

    @field_validator("host_masked_paths")
    @classmethod
    def _masked(cls, paths: list[str]) -> list[str]:
        # The root, /proc, /sys and /dev are refused: a sandbox has its own of the last three.
        return [_allowed_path(path, "images.host_masked_paths") for path in paths]

    def host_allowed(self, tenant: str) -> bool:
        own = self.tenants.get(tenant)
        return own.allow_host if own is not None and own.allow_host is not None else self.allow_host

    def paths_allowed(self, tenant: str) -> tuple[str, ...]:
        own = self.tenants.get(tenant)
        return (*self.allowed_paths, *(own.allowed_paths if own is not None else ()))


class SecretsConfig(ConfigModel):
    """The key that seals secrets (`spec.env` values) in etcd records."""

    key_file: str = Field(
        default="/var/lib/orchard/env/secrets.key",
        description="A file holding a Fernet key (44 url-safe base64 characters). Replicas on "
        "one etcd prefix must share it: a replica with another key refuses to start.",
    )
    generate_key: bool = Field(
        default=True,
        description="Create `key_file` (mode 0600, its directory 0700) with a new key when it is "
        "missing, and say so in the log. False: a missing file stops the start.",
    )

    @field_validator("key_file")
    @classmethod
    def _key_file(cls, path: str) -> str:
        return _host_path(path, "secrets.key_file")


class AgentRouteConfig(ConfigModel):
    """The direct route to sandbox agents (``EnvService.OpenAgentRoute``)."""

    enabled: bool = Field(
        default=True,
        description=(
            "Issue route credentials: a client may then call a sandbox's agent directly with a "
            "credential for that sandbox alone. False: OpenAgentRoute is UNIMPLEMENTED and "
            "every call goes through this service."
        ),
    )
    credential_ttl_s: int = Field(
        default=300,
        ge=10,
        le=86400,
        description=(
            "How long a route credential is valid, seconds. Agents check expiry against their "
            "host's clock, so keep this well above the clock skew between hosts."
        ),
    )


class EnvConfig(ServiceConfig):
    """Everything ``orchard-env`` runs with."""

    server: ServerConfig = ServerConfig(listen=["127.0.0.1:7100"])
    etcd: EtcdConfig = EtcdConfig()
    runtime: dict[str, Any] = Field(
        default_factory=lambda: {"type": "local"},
        description=(
            "The sandbox runtime: `type` picks the backend (`local`, `kubernetes`), the other keys "
            "are that backend's settings, validated by its own model when it loads. `type: "
            "plugin` with `factory: module:callable` loads a runtime from any importable module "
            "(the callable gets the remaining keys as a dict)."
        ),
    )
    auth: AuthConfig = AuthConfig()
    limits: LimitsConfig = LimitsConfig()
    admission: AdmissionConfig = AdmissionConfig()
    privileges: PrivilegesConfig = PrivilegesConfig()
    images: ImagesConfig = ImagesConfig()
    secrets: SecretsConfig = SecretsConfig()
    agent_route: AgentRouteConfig = AgentRouteConfig()
    replica_ttl_s: int = Field(
        default=10,
        ge=2,
        description=(
            "TTL of this process's lease in etcd: a sandbox whose creation this replica was "
            "running is taken over by another replica this long after it died."
        ),
    )
    reconcile_interval_s: float = Field(
        default=30.0, gt=0, description="How often runtime resources are compared with records."
    )
    max_concurrent_creates: int = Field(
        default=64, ge=1, description="runtime.create calls run at once by this replica."
    )
    agent_call_timeout_s: float = Field(
        default=3600.0, gt=0, description="Deadline of an agent call when the caller sets none."
    )
    exec_lane: bool = Field(
        default=True,
        description=(
            "Send Exec to a sandbox's agent over its exec lane when the runtime gives it one "
            "(the same messages in a lean framing: a fraction of gRPC's CPU per call), and let "
            "such an agent start without its gRPC server, which this service starts over the "
            "lane on its first other call (a sandbox that only runs commands costs no gRPC "
            "server); false: every call over gRPC, agents serve gRPC from their start."
        ),
    )

    @field_validator("runtime")
    @classmethod
    def _runtime(cls, runtime: dict[str, Any]) -> dict[str, Any]:
        kind = runtime.get("type")
        if not isinstance(kind, str) or not kind:
            raise ValueError("runtime.type is required (e.g. `local`)")
        if kind == "plugin" and ":" not in str(runtime.get("factory", "")):
            raise ValueError("runtime.factory must be `module:callable` for type plugin")
        if kind == "kubernetes":
            # Checked here, at start, with the backend's own model (pydantic only: no client).
            from orchard.env.runtime.kubernetes.config import (  # noqa: PLC0415
                KubernetesRuntimeConfig,
            )

            KubernetesRuntimeConfig.model_validate(runtime)
        return runtime

    @model_validator(mode="after")
    def _image_tenants(self) -> EnvConfig:
        known = set(self.auth.tenants) | {self.auth.anonymous_tenant}
        unknown = sorted(set(self.images.tenants) - known)
        if unknown:
            raise ValueError(
                f"images.tenants names {unknown}, which auth.tenants does not hold "
                "(nor auth.anonymous_tenant)"
            )
        return self

    @model_validator(mode="after")
    def _etcd_required(self) -> EnvConfig:
        if not self.etcd.endpoints:
            raise ValueError(
                "etcd.endpoints is empty: give an etcd URL "
                "(--set etcd.endpoints=http://127.0.0.1:2379; `orchard up` starts one)"
            )
        return self
