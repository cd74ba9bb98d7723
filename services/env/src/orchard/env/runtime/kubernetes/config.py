"""Configuration of the ``kubernetes`` runtime: where sandbox Pods run and what they get.

Only pydantic here (no Kubernetes client), so the service's own config model can check a
``runtime: {type: kubernetes, ...}`` section without importing kubernetes-asyncio.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["KubernetesRuntimeConfig", "Toleration"]

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class Toleration(BaseModel):
    """One toleration of sandbox Pods, as in a Pod spec (``tolerationSeconds`` camel-cased)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    key: str | None = Field(None, description="Taint key; empty with Exists matches all.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Default Equal.")
    value: str | None = Field(None, description="Taint value (with Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect; empty matches all."
    )
    toleration_seconds: int | None = Field(
        None,
        alias="tolerationSeconds",
        ge=0,
        description="With NoExecute: how long the Pod stays bound after the taint appears.",
    )

    def manifest(self) -> dict[str, object]:
        """The toleration as the Pod spec spells it."""
        return self.model_dump(by_alias=True, exclude_none=True)


class KubernetesRuntimeConfig(BaseModel):
    """The ``kubernetes`` runtime: one Pod per sandbox in one namespace of one cluster."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["kubernetes"] = Field("kubernetes", description="Selects this runtime.")
    namespace: str = Field(
        "orchard-sandboxes",
        description="Namespace of every sandbox Pod and NetworkPolicy (the chart's "
        "sandbox.namespace, with its default-deny policy).",
    )
    inagent_image: str = Field(
        description="Image of the init container that copies the self-contained "
        "orchard-inagent bundle into the Pod (services/inagent/Dockerfile), e.g. "
        "ghcr.io/orchard-dev/orchard-inagent:0.1.0.",
        min_length=1,
    )
    deployment: str = Field(
        "orchard-env",
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$",
        description="Value of the orchard.dev/deployment label on every Pod and policy this "
        "deployment of the env service makes; its watch and reconciliation see only those, so "
        "two deployments can share a namespace.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels sandbox Pods must land on (a node pool)."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints sandbox Pods tolerate (e.g. a spot pool's)."
    )
    priority_class_name: str = Field(
        "", description="PriorityClass of sandbox Pods; empty: the cluster's default."
    )
    image_locality_weight: int = Field(
        50,
        ge=0,
        le=100,
        description="Weight (1-100) of a preferred node affinity toward the nodes whose "
        "Node.status.images already hold a sandbox's image, so it starts without a pull; "
        "never required, so a sandbox still schedules where no node has it. Needs get, list "
        "and watch on nodes (the env chart's ClusterRole); 0: off, no Node is read.",
    )
    image_locality_max_nodes: int = Field(
        100,
        ge=1,
        le=1000,
        description="Most node names one sandbox's affinity term lists (the Pod spec stays "
        "small on a big cluster).",
    )
    prepull_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Default deadline of an image pre-pull (`orchard images prepull`): pulls "
        "still running then are reported as not done and their Pods deleted.",
    )
    api_url: str = Field(
        "",
        description="API server URL used as is, without credentials (`kubectl proxy`, a test "
        "double). Empty: `kubeconfig`, else the in-cluster service account.",
    )
    kubeconfig: str = Field(
        "", description="A kubeconfig file (its current context). Empty: in-cluster."
    )
    agent_port: int = Field(
        7070, ge=1, le=65535, description="Port the agent listens on at the Pod IP."
    )
    shell_images: list[str] = Field(
        default_factory=list,
        description="Patterns (fnmatch) of images known to carry /bin/sh: their agent starts "
        "through `sh -c` after sourcing /etc/profile, so commands see the image's login "
        "environment. Every other image runs the agent directly (any image, even without "
        "a shell or libc).",
    )
    service_account_name: str = Field(
        "",
        description="ServiceAccount of sandbox Pods; its token is never mounted. Empty: the "
        "namespace's default.",
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list, description="Secrets (in the namespace) used to pull task images."
    )
    start_timeout_s: float = Field(
        300.0,
        gt=0,
        description="How long create() waits for the Pod to turn Ready (scheduling and image "
        "pulls included) before it fails with AGENT_START_TIMEOUT and deletes the Pod.",
    )
    delete_timeout_s: float = Field(
        60.0, gt=0, description="How long delete() waits for the Pod to be gone."
    )
    termination_grace_s: int = Field(
        2, ge=0, description="Grace period of a deleted sandbox Pod (SIGTERM, then SIGKILL)."
    )
    watch_timeout_s: int = Field(
        300,
        ge=1,
        description="Server-side timeout of one watch request; the stream then resumes from "
        "the last resourceVersion it saw (no re-list).",
    )
    request_timeout_s: float = Field(30.0, gt=0, description="Deadline of one API call.")
    verify_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Deadline of the agent's identity proof (AgentService.ProveIdentity), at "
        "create and before a replica first talks to a sandbox's agent.",
    )

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, namespace: str) -> str:
        if not _DNS_LABEL.match(namespace):
            raise ValueError(f"namespace {namespace!r} is not a DNS label (a-z, 0-9, '-')")
        return namespace
