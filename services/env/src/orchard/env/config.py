"""Configuration of ``orchard-env``: one frozen pydantic model, validated at start.

Layers (lowest first): defaults, a YAML file (``--config`` or ``$ORCHARD_ENV_CONFIG``),
``ORCHARD_ENV_*`` variables, ``--set key=value``, flags.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from orchard.core.config import ConfigModel, ServerConfig, ServiceConfig

__all__ = [
    "AdmissionConfig",
    "AuthConfig",
    "EnvConfig",
    "EtcdConfig",
    "LimitsConfig",
    "TenantConfig",
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
        default=10 * 1024**3, ge=0, description="Disk of a spec that sets 0."
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
    def _etcd_required(self) -> EnvConfig:
        if not self.etcd.endpoints:
            raise ValueError(
                "etcd.endpoints is empty: give an etcd URL "
                "(--set etcd.endpoints=http://127.0.0.1:2379; `orchard up` starts one)"
            )
        return self
