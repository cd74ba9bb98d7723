"""Pre-pulling images on chosen nodes: one short-lived Pod per node, pinned to it.

A recipe's images are big; pulled on the nodes its sandboxes will use before the run, the
sandboxes start without a pull (and image locality, ``node_images.py``, sends them there). Per
node, one Pod:

- pinned by a *required* node affinity on ``metadata.name`` (what the DaemonSet controller does,
  so the scheduler still checks taints and room), with the sandbox Pods' tolerations and
  priority class, so it lands where sandboxes may;
- an init container copies the self-contained agent executable into an ``emptyDir`` (as in a
  sandbox Pod), then one container per image runs ``orchard-inagent --help`` from it: a no-op
  that works in any image, even without a shell or libc; a container that ran means its image
  is on the node;
- ``restartPolicy: Never``, tiny requests, no capabilities, no service account token; labelled
  ``app.kubernetes.io/managed-by: orchard-env-prepull``, so the sandbox watch and reconciliation
  never see it.

Progress comes from one LIST+WATCH over the run's Pods: per (node, image) ``waiting``,
``pulling``, ``done`` or ``failed`` (with the kubelet's reason). The run ends when every pair is
done or failed, or at its deadline (what is left is reported failed); its Pods are deleted in
every case, also when the caller stops reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kubernetes_asyncio.client import ApiException, CoreV1Api
from kubernetes_asyncio.watch import Watch

from orchard.env.runtime.kubernetes.api import KubeApiError, call_api
from orchard.env.runtime.kubernetes.config import KubernetesRuntimeConfig
from orchard.env.runtime.kubernetes.pods import (
    AGENT_DIR,
    AGENT_EXECUTABLE,
    BUNDLE_IN_IMAGE,
    COPY_CONTAINER,
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    VOLUME,
)

__all__ = [
    "MANAGED_BY_PREPULL",
    "ImagePrepull",
    "PrepullProgress",
    "PullState",
    "prepull_pod_manifest",
    "pull_states",
]

MANAGED_BY_PREPULL = "orchard-env-prepull"
LABEL_PREPULL = "orchard.dev/prepull"
"""The run id: one value per pre-pull, on each of its Pods."""
LABEL_NODE = "orchard.dev/node"

PullStatus = Literal["waiting", "pulling", "done", "failed"]
_PULL_FAILURES = {"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName"}


@dataclass(frozen=True)
class PullState:
    """Where the pull of one image on one node stands."""

    node: str
    image: str
    status: PullStatus
    message: str = ""

    @property
    def finished(self) -> bool:
        return self.status in ("done", "failed")


@dataclass(frozen=True)
class PrepullProgress:
    """Every (node, image) pair of one pre-pull, in node then image order."""

    states: tuple[PullState, ...]
    finished: bool = False

    def count(self, status: PullStatus) -> int:
        return sum(1 for state in self.states if state.status == status)

    @property
    def total(self) -> int:
        return len(self.states)


def _container_name(index: int) -> str:
    return f"pull-{index}"


def prepull_pod_manifest(
    config: KubernetesRuntimeConfig, run_id: str, index: int, node: str, images: Sequence[str]
) -> dict[str, Any]:
    """The pre-pull Pod of one node (see the module docstring)."""
    agent = f"{AGENT_DIR}/{AGENT_EXECUTABLE}"
    small = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}
    locked = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    copy = {
        "name": COPY_CONTAINER,
        "image": config.inagent_image,
        "command": ["cp", "-R", f"{BUNDLE_IN_IMAGE}/.", f"{AGENT_DIR}/"],
        "volumeMounts": [{"name": VOLUME, "mountPath": AGENT_DIR}],
        "resources": small,
    }
    pulls = [
        {
            "name": _container_name(i),
            "image": image,
            "command": [agent, "--help"],
            "volumeMounts": [{"name": VOLUME, "mountPath": AGENT_DIR, "readOnly": True}],
            "resources": small,
            "securityContext": locked,
        }
        for i, image in enumerate(images)
    ]
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 0,
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
            }
        },
        "volumes": [{"name": VOLUME, "emptyDir": {}}],
        "initContainers": [copy],
        "containers": pulls,
    }
    if config.tolerations:
        pod_spec["tolerations"] = [toleration.manifest() for toleration in config.tolerations]
    if config.priority_class_name:
        pod_spec["priorityClassName"] = config.priority_class_name
    if config.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in config.image_pull_secrets]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"prepull-{run_id}-{index}",
            "namespace": config.namespace,
            "labels": {
                LABEL_MANAGED_BY: MANAGED_BY_PREPULL,
                LABEL_DEPLOYMENT: config.deployment,
                LABEL_PREPULL: run_id,
                # Node names are DNS subdomains (up to 253): the label may not hold them all.
                LABEL_NODE: node if len(node) <= 63 else str(index),
            },
            "annotations": {"orchard.dev/images": ",".join(images)},
        },
        "spec": pod_spec,
    }


def pull_states(pod: Mapping[str, Any] | None, node: str, images: Sequence[str]) -> list[PullState]:
    """What one pre-pull Pod's status says of each image (``pod`` None: not seen yet)."""
    if pod is None:
        return [PullState(node, image, "waiting") for image in images]
    status = pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or ()}
    scheduled = conditions.get("PodScheduled") or {}
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        why = f"cannot be scheduled on node {node}: {scheduled.get('message', '')}".rstrip(": ")
        return [PullState(node, image, "failed", why) for image in images]
    for init in status.get("initContainerStatuses") or ():
        state = init.get("state") or {}
        waiting = state.get("waiting") or {}
        terminated = state.get("terminated") or {}
        reason = str(waiting.get("reason") or "")
        if reason in _PULL_FAILURES or (terminated and terminated.get("exitCode") != 0):
            why = (
                f"the agent image {init.get('image', '')!r} could not run on node {node}: "
                f"{reason or terminated.get('reason', '')} "
                f"{waiting.get('message') or terminated.get('message') or ''}"
            ).strip()
            return [PullState(node, image, "failed", why) for image in images]
    by_name = {c.get("name"): c for c in status.get("containerStatuses") or ()}
    states = []
    for index, image in enumerate(images):
        container = by_name.get(_container_name(index)) or {}
        state = container.get("state") or {}
        waiting = state.get("waiting") or {}
        reason = str(waiting.get("reason") or "")
        if "running" in state or "terminated" in state:
            states.append(PullState(node, image, "done"))
        elif reason in _PULL_FAILURES:
            states.append(
                PullState(node, image, "failed", f"{reason}: {waiting.get('message', '')}")
            )
        elif container and status.get("phase") in ("Running", "Pending") and reason:
            states.append(PullState(node, image, "pulling", reason))
        elif status.get("phase") == "Failed":
            why = f"the pre-pull Pod failed: {status.get('reason', '')} {status.get('message', '')}"
            states.append(PullState(node, image, "failed", why.strip()))
        else:
            states.append(PullState(node, image, "waiting"))
    return states


class ImagePrepull:
    """One pre-pull run (see the module docstring): ``async for progress in run.progress()``."""

    def __init__(
        self,
        core: CoreV1Api,
        config: KubernetesRuntimeConfig,
        nodes: Sequence[str],
        images: Sequence[str],
        timeout_s: float,
    ) -> None:
        self.core = core
        self.config = config
        self.nodes = list(dict.fromkeys(nodes))
        self.images = list(dict.fromkeys(images))
        self.timeout_s = timeout_s
        self.run_id = uuid.uuid4().hex[:10]
        self._pods: dict[str, dict[str, Any] | None] = {}  # Pod name -> last object seen
        self._node_of: dict[str, str] = {}

    async def progress(self) -> AsyncGenerator[PrepullProgress, None]:
        """Create the Pods, yield progress on every change, delete the Pods at the end."""
        deadline = time.monotonic() + self.timeout_s
        try:
            for index, node in enumerate(self.nodes):
                manifest = prepull_pod_manifest(self.config, self.run_id, index, node, self.images)
                name = manifest["metadata"]["name"]
                self._node_of[name] = node
                self._pods[name] = None
                await call_api(
                    self.core.create_namespaced_pod(
                        self.config.namespace,
                        manifest,  # type: ignore[arg-type]  # sent as is
                        _preload_content=False,
                        _request_timeout=self.config.request_timeout_s,
                    )
                )
            last: PrepullProgress | None = None
            async for _ in self._changes(deadline):
                now = self._snapshot()
                if now != last:
                    last = now
                    yield now
                if all(state.finished for state in now.states):
                    break
            final = self._snapshot(give_up=True)
            yield PrepullProgress(final.states, finished=True)
        finally:
            await asyncio.shield(self._delete_pods())

    def _snapshot(self, *, give_up: bool = False) -> PrepullProgress:
        states: list[PullState] = []
        for name, node in self._node_of.items():
            for state in pull_states(self._pods.get(name), node, self.images):
                if give_up and not state.finished:
                    why = state.message or state.status
                    states.append(
                        PullState(
                            state.node,
                            state.image,
                            "failed",
                            f"not pulled within {self.timeout_s:g} s ({why})",
                        )
                    )
                else:
                    states.append(state)
        return PrepullProgress(tuple(states))

    async def _changes(self, deadline: float) -> AsyncIterator[None]:
        """One item after the LIST and after every change of the run's Pods, until the
        deadline."""
        selector = f"{LABEL_PREPULL}={self.run_id}"
        version = ""
        while time.monotonic() < deadline:
            if not version:
                data = await call_api(
                    self.core.list_namespaced_pod(
                        self.config.namespace,
                        label_selector=selector,
                        _preload_content=False,
                        _request_timeout=self.config.request_timeout_s,
                    )
                )
                for item in data.get("items") or ():
                    self._pods[item["metadata"]["name"]] = item
                version = str((data.get("metadata") or {}).get("resourceVersion", ""))
                yield None
            window = max(1, min(int(deadline - time.monotonic()), self.config.watch_timeout_s))
            try:
                async with Watch(return_type="object") as watch:
                    events = watch.stream(
                        self.core.list_namespaced_pod,
                        self.config.namespace,
                        label_selector=selector,
                        resource_version=version,
                        allow_watch_bookmarks=True,
                        timeout_seconds=window,
                        _request_timeout=window + self.config.request_timeout_s,
                    ).__aiter__()
                    while True:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return
                        try:
                            event = await asyncio.wait_for(events.__anext__(), left)
                        except (StopAsyncIteration, TimeoutError):
                            break
                        obj = event["raw_object"]
                        metadata = obj.get("metadata") or {}
                        version = str(metadata.get("resourceVersion") or version)
                        name = metadata.get("name")
                        if event["type"] == "BOOKMARK" or name not in self._node_of:
                            continue
                        self._pods[name] = None if event["type"] == "DELETED" else obj
                        yield None
            except ApiException as exc:
                if exc.status != 410:
                    raise
                version = ""  # expired: list again

    async def _delete_pods(self) -> None:
        for name in self._node_of:
            with contextlib.suppress(KubeApiError):
                await call_api(
                    self.core.delete_namespaced_pod(
                        name,
                        self.config.namespace,
                        grace_period_seconds=0,
                        _preload_content=False,
                        _request_timeout=self.config.request_timeout_s,
                    )
                )
