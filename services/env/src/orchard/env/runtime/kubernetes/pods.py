"""The sandbox Pod manifest, and what a sandbox Pod's status means for the sandbox.

One Pod per sandbox, named after the sandbox id (also its hostname):

- labels: the sandbox id, the env deployment that made it (its watch and reconciliation select
  on that), and the sandbox's owner (``spec.owner_id``, sanitized to a label value; the exact id
  in an annotation) when it has one;
- an ``emptyDir`` volume; an init container from the inagent image copies the self-contained
  ``orchard-inagent`` bundle into it (the image's own ``cp``: ``services/inagent/Dockerfile``);
- the task image's container runs that executable as its entrypoint, read-only from the
  volume, listening on the Pod IP (the downward API's ``status.podIP``): directly, so any Linux
  image works, or through ``sh -c`` for images the configuration lists as having a shell;
- requests equal limits from the sandbox request (cpu, memory, ephemeral storage);
- the sandbox's agent key (``identity.py``) as the agent's ``ORCHARD_AGENT_KEY``, from a Secret
  of its own (``secretKeyRef``): the agent takes it out of its environment at start and makes
  itself non-dumpable, so commands (without ``CAP_SYS_PTRACE``, dropped) cannot read it; with
  it the agent also checks route credentials (``EnvService.OpenAgentRoute``), and
  ``ORCHARD_AGENT_SANDBOX_ID`` names the sandbox they must be for; the agent runs with
  ``require_credential`` and serves no call without one (orchard-env sends its own);
- the spec's ``env`` values in that same Secret, each variable a ``secretKeyRef`` (so no value
  is in the Pod spec, and Kubernetes expands no ``$(VAR)`` inside one); ``ORCHARD_*``
  variables, which the agent takes as its own settings, go to it as one JSON value
  (``ORCHARD_INAGENT_ENV``: its ``env`` setting) and reach commands from there;
- a readiness probe on the agent's ``grpc.health.v1`` service;
- node selector, tolerations and priority class from the configuration;
- a preferred node affinity (``image_locality_weight``, never required) toward the nodes that
  already hold the image (``node_images.py``).

Pure functions, no client: the manifest is a plain dict, checked by a snapshot test.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchard.env.runtime.base import (
    FailureReason,
    RuntimeNotSupported,
    RuntimeResources,
    RuntimeSandboxSpec,
)
from orchard.env.runtime.kubernetes.config import KubernetesRuntimeConfig

__all__ = [
    "AGENT_DIR",
    "AGENT_EXECUTABLE",
    "KEY_FIELD",
    "KEY_VARIABLE",
    "LABEL_DEPLOYMENT",
    "LABEL_MANAGED_BY",
    "LABEL_OWNER",
    "LABEL_SANDBOX",
    "PodView",
    "check_sandbox_id",
    "image_locality",
    "key_secret_manifest",
    "key_secret_name",
    "label_value",
    "pod_manifest",
    "sandbox_selector",
]

LABEL_SANDBOX = "orchard.dev/sandbox-id"
LABEL_OWNER = "orchard.dev/owner"
"""The sandbox's owner (``spec.owner_id``), as a label value; absent when it has its own lease."""
LABEL_DEPLOYMENT = "orchard.dev/deployment"
"""The env deployment that made the Pod or policy (``KubernetesRuntimeConfig.deployment``)."""
ANNOTATION_OWNER = "orchard.dev/owner-id"
"""The owner id exactly, where the label holds it sanitized."""
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "orchard-env"
ANNOTATION_LABELS = "orchard.dev/labels"
AGENT_DIR = "/.orchard/inagent"
"""Where the emptyDir holding the agent bundle is mounted, in both containers."""
AGENT_EXECUTABLE = "orchard-inagent"
BUNDLE_IN_IMAGE = "/opt/orchard-inagent"
"""Where the inagent image keeps the bundle (services/inagent/Dockerfile)."""
POD_IP_VAR = "ORCHARD_POD_IP"
KEY_VARIABLE = "ORCHARD_AGENT_KEY"
"""The agent's environment variable holding the sandbox's key (services/inagent)."""
SANDBOX_ID_VARIABLE = "ORCHARD_AGENT_SANDBOX_ID"
"""The agent's environment variable naming its sandbox (services/inagent)."""
KEY_FIELD = "agent-key"
AGENT_ENV_FIELD = "agent-env"
AGENT_ENV_VARIABLE = "ORCHARD_INAGENT_ENV"
"""The agent's ``env`` setting (JSON), from the environment: the spec's ``ORCHARD_*`` variables."""
"""The key's field in the sandbox's Secret."""
SANDBOX_CONTAINER = "sandbox"
COPY_CONTAINER = "inagent-copy"
VOLUME = "orchard-inagent"

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_NOT_IN_LABEL = re.compile(r"[^-A-Za-z0-9_.]+")
_SHELL_ENTRY = f'. /etc/profile >/dev/null 2>&1; exec {AGENT_DIR}/{AGENT_EXECUTABLE} "$@"'
_PULL_FAILURES = {"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull"}
_BAD_IMAGE = {"InvalidImageName"}
_START_FAILURES = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
_EVICTION_REASONS = {"Evicted", "EvictionByEvictionAPI", "TerminationByKubelet", "OutOfpods"}
_PREEMPTION_REASONS = {"Preempted", "PreemptionByScheduler", "Shutdown", "NodeShutdown"}


def check_sandbox_id(sandbox_id: str) -> None:
    """Pod names are DNS labels: the sandbox id must be one."""
    if not _DNS_LABEL.fullmatch(sandbox_id):
        raise ValueError(
            f"sandbox id {sandbox_id!r}: the kubernetes runtime needs a DNS label "
            "(1-63 of a-z, 0-9, '-', starting and ending alphanumeric)"
        )


def label_value(text: str) -> str:
    """``text`` as a valid label value (at most 63 of A-Z, a-z, 0-9, ``-_.``, alphanumeric at
    both ends). A value that had to change ends in 8 hex digits of its SHA-256, so two different
    ids do not collapse into one label."""
    if _LABEL_VALUE.fullmatch(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    cleaned = _NOT_IN_LABEL.sub("-", text).strip("-_.")[: 63 - 9].rstrip("-_.")
    return f"{cleaned}-{digest}" if cleaned else digest


def sandbox_selector(config: KubernetesRuntimeConfig) -> str:
    """The label selector of every Pod and policy this runtime made."""
    return f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_DEPLOYMENT}={config.deployment}"


def sandbox_labels(
    config: KubernetesRuntimeConfig, sandbox_id: str, owner: str = ""
) -> dict[str, str]:
    labels = {
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_DEPLOYMENT: config.deployment,
        LABEL_SANDBOX: sandbox_id,
    }
    if owner:
        labels[LABEL_OWNER] = label_value(owner)
    return labels


def key_secret_name(sandbox_id: str) -> str:
    """The Secret holding the sandbox's agent key (a DNS subdomain: up to 253 characters)."""
    return f"{sandbox_id}-agent-key"


def _env_field(index: int) -> str:
    # Secret keys allow only [-._a-zA-Z0-9]; a variable's name may hold more.
    return f"env-{index}"


def _plain_env(env: Mapping[str, str]) -> list[str]:
    """The names of the variables that commands get as container variables, in order."""
    return sorted(name for name in env if not name.startswith("ORCHARD_"))


def key_secret_manifest(
    config: KubernetesRuntimeConfig,
    sandbox_id: str,
    key: str,
    owner: str = "",
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The Secret of one sandbox: its agent key and its spec's env values. Labelled as its Pod
    (reconciliation finds a leftover), immutable."""
    env = env or {}
    data = {KEY_FIELD: key}
    data.update({_env_field(i): env[name] for i, name in enumerate(_plain_env(env))})
    agent_own = {k: v for k, v in env.items() if k.startswith("ORCHARD_")}
    if agent_own:
        data[AGENT_ENV_FIELD] = json.dumps(agent_own, sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": key_secret_name(sandbox_id),
            "namespace": config.namespace,
            "labels": sandbox_labels(config, sandbox_id, owner),
        },
        "type": "Opaque",
        "immutable": True,
        "data": {field: base64.b64encode(value.encode()).decode() for field, value in data.items()},
    }


def _quantities(resources: RuntimeResources) -> dict[str, str]:
    amounts = {}
    if resources.cpu_millis:
        amounts["cpu"] = f"{resources.cpu_millis}m"
    if resources.memory_bytes:
        amounts["memory"] = str(resources.memory_bytes)
    if resources.disk_bytes:
        amounts["ephemeral-storage"] = str(resources.disk_bytes)
    return amounts


def _agent_args(spec: RuntimeSandboxSpec, config: KubernetesRuntimeConfig) -> list[str]:
    # The agent serves only calls with a route credential (orchard-env's own or a client's from
    # EnvService.OpenAgentRoute): its port may be open to client Pods (the chart's
    # agentRoute.clients), and a call without one is refused.
    return [
        "--listen",
        f"$({POD_IP_VAR}):{config.agent_port}",
        "--working-dir",
        _workdir(spec),
        "--set",
        "require_credential=true",
    ]


def _from_secret(name: str, sandbox_id: str, field: str) -> dict[str, Any]:
    return {
        "name": name,
        "valueFrom": {"secretKeyRef": {"name": key_secret_name(sandbox_id), "key": field}},
    }


def _workdir(spec: RuntimeSandboxSpec) -> str:
    import posixpath  # noqa: PLC0415 - tiny

    return posixpath.normpath(posixpath.join("/", spec.working_dir or "/"))


def uses_shell(config: KubernetesRuntimeConfig, image: str) -> bool:
    return any(fnmatch.fnmatchcase(image, pattern) for pattern in config.shell_images)


def _security_context(spec: RuntimeSandboxSpec) -> dict[str, Any]:
    """What the sandbox container's commands may do: no CAP_NET_RAW unless asked for, never
    CAP_SYS_PTRACE (it would open the agent's /proc/1/environ, which holds the sandbox's key;
    container runtimes leave it out by default, this says so whatever a node's default), the
    container runtime's default seccomp profile (it refuses new user namespaces to a process
    without CAP_SYS_ADMIN), no privilege gained through exec."""
    if spec.user_namespaces:
        raise RuntimeNotSupported(
            "user namespaces (SandboxPrivileges.user_namespaces) are not supported by the "
            "kubernetes runtime yet: the Pod's RuntimeDefault seccomp profile refuses them"
        )
    capabilities: dict[str, list[str]] = (
        {"add": ["NET_RAW"], "drop": ["SYS_PTRACE"]}
        if spec.raw_sockets
        else {"drop": ["NET_RAW", "SYS_PTRACE"]}
    )
    return {
        "capabilities": capabilities,
        "seccompProfile": {"type": "RuntimeDefault"},
        "allowPrivilegeEscalation": False,
    }


def image_locality(config: KubernetesRuntimeConfig, nodes: Sequence[str]) -> dict[str, Any] | None:
    """A preferred (never required) node affinity toward ``nodes``, the nodes that already
    hold the sandbox's image; None when there are none or the weight is 0."""
    if not nodes or not config.image_locality_weight:
        return None
    names = sorted(nodes)[: config.image_locality_max_nodes]
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": names}]}
    return {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": config.image_locality_weight, "preference": term}
            ]
        }
    }


def pod_manifest(
    spec: RuntimeSandboxSpec,
    config: KubernetesRuntimeConfig,
    image_nodes: Sequence[str] = (),
) -> dict[str, Any]:
    """The Pod of one sandbox (see the module docstring); ``image_nodes``: the nodes known to
    hold its image, which it prefers."""
    check_sandbox_id(spec.sandbox_id)
    agent = f"{AGENT_DIR}/{AGENT_EXECUTABLE}"
    if uses_shell(config, spec.image):
        command = ["/bin/sh", "-c", _SHELL_ENTRY, AGENT_EXECUTABLE]
    else:
        command = [agent]
    # Kubernetes expands $(VAR) in args only for variables defined before, in `env`.
    env: list[dict[str, Any]] = [
        {"name": POD_IP_VAR, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        _from_secret(KEY_VARIABLE, spec.sandbox_id, KEY_FIELD),
        # The agent refuses a route credential for another sandbox by name.
        {"name": SANDBOX_ID_VARIABLE, "value": spec.sandbox_id},
    ]
    if any(name.startswith("ORCHARD_") for name in spec.env):
        # The agent takes ORCHARD_* variables as its own settings and hides them from commands:
        # a sandbox's ORCHARD_* variables reach commands as the agent's `env` setting.
        env.append(_from_secret(AGENT_ENV_VARIABLE, spec.sandbox_id, AGENT_ENV_FIELD))
    env += [
        _from_secret(name, spec.sandbox_id, _env_field(index))
        for index, name in enumerate(_plain_env(spec.env))
    ]
    amounts = _quantities(spec.resources)
    container: dict[str, Any] = {
        "name": SANDBOX_CONTAINER,
        "image": spec.image,
        "command": command,
        "args": _agent_args(spec, config),
        "env": env,
        "workingDir": _workdir(spec),
        "ports": [{"name": "inagent", "containerPort": config.agent_port, "protocol": "TCP"}],
        "volumeMounts": [{"name": VOLUME, "mountPath": AGENT_DIR, "readOnly": True}],
        "readinessProbe": {
            "grpc": {"port": config.agent_port},
            "periodSeconds": 1,
            "timeoutSeconds": 1,
            "failureThreshold": 3,
        },
        "resources": {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {},
        "securityContext": _security_context(spec),
    }
    copy: dict[str, Any] = {
        "name": COPY_CONTAINER,
        "image": config.inagent_image,
        "command": ["cp", "-R", f"{BUNDLE_IN_IMAGE}/.", f"{AGENT_DIR}/"],
        "volumeMounts": [{"name": VOLUME, "mountPath": AGENT_DIR}],
        "resources": {
            "requests": {"cpu": "10m", "memory": "16Mi"},
            "limits": {"memory": "64Mi"},
        },
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": config.termination_grace_s,
        "volumes": [{"name": VOLUME, "emptyDir": {}}],
        "initContainers": [copy],
        "containers": [container],
    }
    if config.node_selector:
        pod_spec["nodeSelector"] = dict(config.node_selector)
    if config.tolerations:
        pod_spec["tolerations"] = [toleration.manifest() for toleration in config.tolerations]
    if config.priority_class_name:
        pod_spec["priorityClassName"] = config.priority_class_name
    if config.service_account_name:
        pod_spec["serviceAccountName"] = config.service_account_name
    if config.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in config.image_pull_secrets]
    affinity = image_locality(config, image_nodes)
    if affinity is not None:
        pod_spec["affinity"] = affinity
    annotations = {ANNOTATION_LABELS: json.dumps(dict(spec.labels), sort_keys=True)}
    if spec.owner:
        annotations[ANNOTATION_OWNER] = spec.owner
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": spec.sandbox_id,
            "namespace": config.namespace,
            "labels": sandbox_labels(config, spec.sandbox_id, spec.owner),
            "annotations": annotations,
        },
        "spec": pod_spec,
    }


@dataclass(frozen=True)
class PodFailure:
    reason: FailureReason
    message: str


@dataclass(frozen=True)
class PodView:
    """What the runtime reads from one Pod object of the watch (a JSON dict)."""

    name: str
    resource_version: str
    phase: str
    pod_ip: str
    uid: str
    ready: bool
    deleting: bool
    failure: PodFailure | None
    waiting_for: str  # why it is not Ready yet (unschedulable, pulling), for timeout messages

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> PodView:
        metadata = pod.get("metadata") or {}
        status = pod.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or ()}
        ready = (conditions.get("Ready") or {}).get("status") == "True"
        return cls(
            name=str(metadata.get("name", "")),
            resource_version=str(metadata.get("resourceVersion", "")),
            phase=str(status.get("phase") or "Pending"),
            pod_ip=str(status.get("podIP") or ""),
            uid=str(metadata.get("uid") or ""),
            ready=ready,
            deleting=bool(metadata.get("deletionTimestamp")),
            failure=_failure(status, conditions),
            waiting_for=_waiting_for(status, conditions),
        )

    @property
    def running(self) -> bool:
        return self.phase in ("Pending", "Running") and self.failure is None


def _waiting_for(status: Mapping[str, Any], conditions: Mapping[str, Any]) -> str:
    scheduled = conditions.get("PodScheduled") or {}
    if scheduled.get("status") == "False":
        return f"not scheduled: {scheduled.get('reason', '')} {scheduled.get('message', '')}"
    for key in ("initContainerStatuses", "containerStatuses"):
        for container in status.get(key) or ():
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting:
                return f"{container.get('name')}: {waiting.get('reason', '')}".strip()
    return f"phase {status.get('phase') or 'Pending'}, not Ready"


def _failure(status: Mapping[str, Any], conditions: Mapping[str, Any]) -> PodFailure | None:
    """Why the sandbox in this Pod cannot (or no longer) serve; None while it can."""
    reason = str(status.get("reason") or "")
    message = str(status.get("message") or "")
    disruption = conditions.get("DisruptionTarget") or {}
    disrupted = str(disruption.get("reason") or "") if disruption.get("status") == "True" else ""
    for known, kind in (
        (_EVICTION_REASONS, FailureReason.EVICTED),
        (_PREEMPTION_REASONS, FailureReason.PREEMPTED),
    ):
        if reason in known or (status.get("phase") == "Failed" and disrupted in known):
            why = reason or disrupted
            return PodFailure(
                kind, f"the sandbox Pod was {kind.value.lower()} ({why}): {message}".rstrip(": ")
            )
    for key, where in (("initContainerStatuses", "the inagent copy"), ("containerStatuses", "")):
        for container in status.get(key) or ():
            state = container.get("state") or {}
            image = container.get("image", "")
            waiting = state.get("waiting") or {}
            why = str(waiting.get("reason") or "")
            detail = str(waiting.get("message") or "")
            if why in _PULL_FAILURES:
                return PodFailure(
                    FailureReason.IMAGE_NOT_FOUND, f"image {image!r} cannot be pulled: {detail}"
                )
            if why in _BAD_IMAGE:
                return PodFailure(FailureReason.IMAGE_INVALID, f"image {image!r}: {detail}")
            if why in _START_FAILURES:
                return PodFailure(FailureReason.IMAGE_INVALID, f"{why}: {detail}")
            terminated = state.get("terminated")
            if terminated is None:
                continue
            code = terminated.get("exitCode")
            if key == "initContainerStatuses" and code == 0:
                continue
            ended = str(terminated.get("reason") or "")
            text = str(terminated.get("message") or "")
            if ended == "OOMKilled":
                return PodFailure(
                    FailureReason.OUT_OF_MEMORY,
                    f"{where or 'the agent'} was killed for memory (OOMKilled); raise the "
                    "sandbox's memory",
                )
            subject = where or "the agent"
            return PodFailure(
                FailureReason.AGENT_EXITED,
                f"{subject} exited with status {code} ({ended or 'no reason'}) {text}".strip(),
            )
    if status.get("phase") in ("Failed", "Succeeded"):
        return PodFailure(
            FailureReason.RUNTIME_DIED,
            f"the sandbox Pod is {status.get('phase')}: {reason} {message}".strip(),
        )
    return None
