"""The ``kubernetes`` runtime: one Pod per sandbox, made with kubernetes-asyncio.

- **Create** writes the sandbox's NetworkPolicy first when its request allows destinations
  (``policies.py``), then the Secret of its agent key (``identity.py``), then its Pod
  (``pods.py``), makes the Pod the Secret's owner, and returns once the Pod is Ready (its
  readiness probe on the agent's gRPC health passed) and its agent proved it holds the key.
  It learns of readiness from the one LIST+WATCH stream over every sandbox Pod
  (``pod_watch.py``); no call polls a Pod. A Pod that cannot start (image not pullable, the
  agent exits, killed for memory) fails the create with that reason, and whatever was made
  is deleted.
- **The hot path** is the Pod IP: the agent listens on ``<pod IP>:<agent_port>`` and the
  service dials it directly; the API server is never on the exec or file path.
- **Identity**: ``verify_agent`` reads the key from the Secret and asks what serves at the
  address to prove it holds it (``identity.py``); one GET and one call per replica and sandbox.
- **Exits** come from the same stream: a Ready sandbox whose Pod fails is reported with the
  reason (``EVICTED``, ``PREEMPTED``, ``OUT_OF_MEMORY``, ``AGENT_EXITED``), and one whose Pod was
  deleted by someone else as ``RUNTIME_DIED``.
- **Delete** deletes the Pod (its grace period), the policy and the key's Secret, and returns
  once the Pod is gone from the stream. **Egress expiry**: a timer rewrites the policy at the
  next expiry and deletes it when no rule is left; a restarted runtime schedules the timers
  again from the policies' annotations.
- **Reconciliation**: ``list_sandboxes`` names every Pod, policy and key Secret with this
  deployment's labels; the service deletes those without a record (orphans).
- **Image locality**: a second LIST+WATCH, over Nodes (``node_images.py``), knows which nodes
  hold which images; a sandbox Pod prefers those holding its image (a weighted preferred node
  affinity, never required). Without permission to read Nodes the runtime says so once and
  places sandboxes as the scheduler alone would.
- **Pre-pull**: ``prepull_images`` pulls images on chosen nodes ahead of a run, one Pod per
  node (``prepull.py``), and reports progress per node and image.

Sandboxes outlive the service: a new runtime finds them through its first LIST.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio import config as kube_config

from orchard.env.runtime.base import (
    AgentUnreachable,
    EgressRule,
    FailureReason,
    Runtime,
    RuntimeFailure,
    RuntimeNotSupported,
    RuntimeSandbox,
    RuntimeSandboxSpec,
    RuntimeUnavailable,
    SandboxExit,
    SandboxStatus,
)
from orchard.env.runtime.kubernetes.api import KubeApiError, call_api
from orchard.env.runtime.kubernetes.config import KubernetesRuntimeConfig
from orchard.env.runtime.kubernetes.identity import new_key, prove
from orchard.env.runtime.kubernetes.node_images import NodeImageIndex
from orchard.env.runtime.kubernetes.pod_watch import SandboxPodWatch
from orchard.env.runtime.kubernetes.pods import (
    KEY_FIELD,
    LABEL_SANDBOX,
    PodView,
    check_sandbox_id,
    key_secret_manifest,
    key_secret_name,
    pod_manifest,
    sandbox_selector,
)
from orchard.env.runtime.kubernetes.policies import (
    LABEL_PEER_SOURCE,
    live_rules,
    next_expiry,
    peer_policies,
    policy_manifest,
    policy_name,
    rules_from_policy,
)
from orchard.env.runtime.kubernetes.prepull import ImagePrepull, PrepullProgress

__all__ = ["KubernetesRuntime"]

log = logging.getLogger(__name__)

_LOCAL_IMAGES = ("rootfs:", "oci-archive:", "docker-archive:")


def agent_address(pod_ip: str, port: int) -> str:
    host = f"[{pod_ip}]" if ipaddress.ip_address(pod_ip).version == 6 else pod_ip
    return f"{host}:{port}"


def _create_failure(exc: KubeApiError, what: str) -> RuntimeFailure:
    if exc.code == 403 and "quota" in exc.message:
        return RuntimeFailure(FailureReason.RESOURCES_UNAVAILABLE, f"{what}: {exc.message}")
    if exc.code == 409:
        return RuntimeFailure(FailureReason.INTERNAL, f"{what} exists already; delete it first")
    if exc.code == 422 and "image" in exc.message:
        return RuntimeFailure(FailureReason.IMAGE_INVALID, f"{what}: {exc.message}")
    return RuntimeFailure(FailureReason.INTERNAL, f"{what}: the API server answered {exc}")


class KubernetesRuntime(Runtime):
    """Sandboxes as Pods in one namespace (see the module docstring)."""

    name = "kubernetes"

    def __init__(self, config: KubernetesRuntimeConfig) -> None:
        self.config = config
        self._api: client.ApiClient | None = None
        self._core: client.CoreV1Api | None = None
        self._net: client.NetworkingV1Api | None = None
        self._pods: SandboxPodWatch | None = None
        self._node_images: NodeImageIndex | None = None
        self._policies: set[str] = set()  # sandbox ids with a policy
        self._peer_sources: set[str] = set()  # sandbox ids that may have peer policies
        self._egress: dict[str, tuple[EgressRule, ...]] = {}
        self._expiry_timers: dict[str, asyncio.TimerHandle] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._creating: set[str] = set()
        self._deleting: set[str] = set()
        self._reported: set[str] = set()
        self._keys: dict[str, str] = {}  # agent keys this runtime made or read, by sandbox id
        self._exits: asyncio.Queue[SandboxExit | None] = asyncio.Queue()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._pods is not None:
            return
        configuration = await self._client_configuration()
        self._api = client.ApiClient(configuration)
        self._core = client.CoreV1Api(self._api)
        self._net = client.NetworkingV1Api(self._api)
        self._pods = SandboxPodWatch(
            self._core,
            self.config.namespace,
            sandbox_selector(self.config),
            on_change=self._on_pod_change,
            watch_timeout_s=self.config.watch_timeout_s,
            request_timeout_s=self.config.request_timeout_s,
        )
        try:
            await self._list_policies(schedule=True)
            await self._list_key_secrets()
            await self._pods.start()
        except KubeApiError as exc:
            await self._close_client()
            raise RuntimeUnavailable(
                "the kubernetes runtime cannot list pods, networkpolicies and secrets in "
                f"namespace {self.config.namespace!r}: {exc} (the env chart's Role grants all "
                "three; check the namespace exists and the API server is reachable)"
            ) from None
        await self._start_node_images()
        log.info(
            "kubernetes runtime ready",
            extra={"namespace": self.config.namespace, "sandboxes": self._pods.names()},
        )

    async def _start_node_images(self) -> None:
        if not self.config.image_locality_weight:
            return
        index = NodeImageIndex(
            self._core_api(),
            watch_timeout_s=self.config.watch_timeout_s,
            request_timeout_s=self.config.request_timeout_s,
        )
        try:
            await index.start()
        except KubeApiError as exc:
            log.warning(
                "image locality is off: the kubernetes runtime cannot list nodes (%s); the env "
                "chart's ClusterRole grants get, list and watch on nodes "
                "(sandbox.imageLocality.weight > 0), or set runtime.image_locality_weight: 0",
                exc,
            )
            return
        self._node_images = index

    async def _client_configuration(self) -> client.Configuration:
        if self.config.api_url:
            return client.Configuration(host=self.config.api_url)
        configuration = client.Configuration()
        try:
            if self.config.kubeconfig:
                await kube_config.load_kube_config(
                    config_file=self.config.kubeconfig, client_configuration=configuration
                )
            else:
                kube_config.load_incluster_config(  # type: ignore[no-untyped-call]
                    client_configuration=configuration
                )
        except (kube_config.ConfigException, OSError) as exc:
            where = self.config.kubeconfig or "the in-cluster service account"
            raise RuntimeUnavailable(
                f"the kubernetes runtime has no API server credentials from {where}: {exc}; "
                "run the service in the cluster (the env chart), or set runtime.kubeconfig "
                "or runtime.api_url"
            ) from None
        return configuration

    async def close(self) -> None:
        for timer in self._expiry_timers.values():
            timer.cancel()
        self._expiry_timers.clear()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._node_images is not None:
            await self._node_images.close()
            self._node_images = None
        if self._pods is not None:
            await self._pods.close()
            self._pods = None
        await self._close_client()
        self._exits.put_nowait(None)

    async def _close_client(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None

    # -- sandboxes ---------------------------------------------------------------------------

    async def create(self, spec: RuntimeSandboxSpec) -> RuntimeSandbox:
        pods = self._watch()
        check_sandbox_id(spec.sandbox_id)
        sandbox_id = spec.sandbox_id
        if spec.image == "host" or spec.image.startswith(_LOCAL_IMAGES):
            raise RuntimeFailure(
                FailureReason.IMAGE_INVALID,
                f"image {spec.image!r} is a local runtime image; the kubernetes runtime runs "
                "registry references (e.g. python:3.12-slim)",
            )
        manifest = pod_manifest(spec, self.config, self.image_nodes(spec.image))
        async with self._lock(sandbox_id):
            if pods.view(sandbox_id) is not None or sandbox_id in self._policies:
                raise RuntimeFailure(
                    FailureReason.INTERNAL, f"sandbox {sandbox_id} exists already; delete it first"
                )
            self._creating.add(sandbox_id)
            try:
                return await self._create_locked(spec, manifest, new_key())
            except BaseException:
                # Shielded: a cancelled create still deletes what it made.
                await asyncio.shield(self._delete_locked(sandbox_id))
                raise
            finally:
                self._creating.discard(sandbox_id)

    async def _create_locked(
        self, spec: RuntimeSandboxSpec, manifest: dict[str, Any], key: str
    ) -> RuntimeSandbox:
        sandbox_id = spec.sandbox_id
        if spec.egress:
            await self._write_policy(sandbox_id, tuple(spec.egress))
        # Before the Pod: the kubelet needs the Secret to start the agent's container.
        await self._create_key_secret(spec, key)
        try:
            pod = await call_api(
                self._core_api().create_namespaced_pod(
                    self.config.namespace,
                    manifest,  # type: ignore[arg-type]  # the client sends dicts as they are
                    _preload_content=False,
                    _request_timeout=self.config.request_timeout_s,
                )
            )
        except KubeApiError as exc:
            raise _create_failure(exc, f"sandbox Pod {sandbox_id}") from None
        await self._own_key_secret(sandbox_id, pod)
        seen = False

        def started(view: PodView | None) -> bool:
            nonlocal seen  # the create's answer may come before the stream's ADDED event
            seen = seen or view is not None
            return (view is None and seen) or (
                view is not None and (view.ready or view.failure is not None)
            )

        try:
            view = await self._watch().wait_for(sandbox_id, started, self.config.start_timeout_s)
        except TimeoutError:
            now = self._watch().view(sandbox_id)
            raise RuntimeFailure(
                FailureReason.AGENT_START_TIMEOUT,
                f"sandbox Pod {sandbox_id} not Ready after {self.config.start_timeout_s:g} s "
                f"({now.waiting_for if now else 'gone'})",
            ) from None
        if view is None:
            raise RuntimeFailure(
                FailureReason.RUNTIME_DIED, f"sandbox Pod {sandbox_id} was deleted while starting"
            )
        if view.failure is not None:
            raise RuntimeFailure(view.failure.reason, view.failure.message)
        address = agent_address(view.pod_ip, self.config.agent_port)
        self._keys[sandbox_id] = key
        try:
            version = await prove(address, key, sandbox_id, self.config.verify_timeout_s)
        except AgentUnreachable as exc:
            raise RuntimeFailure(FailureReason.AGENT_EXITED, str(exc)) from None
        if version is None:
            raise RuntimeFailure(
                FailureReason.INTERNAL,
                f"the agent of sandbox {sandbox_id} did not prove it holds the sandbox's key: "
                f"is {self.config.inagent_image!r} an agent older than this service?",
            )
        return RuntimeSandbox(
            sandbox_id,
            address,
            agent_version=version,
            network_address=view.pod_ip if spec.ingress_ports else "",
        )

    async def agent_key(self, sandbox_id: str) -> bytes | None:
        """The key in the sandbox's Secret (read once per replica); None without one."""
        key = self._keys.get(sandbox_id) or await self._read_key(sandbox_id)
        return key.encode() if key else None

    async def verify_agent(self, sandbox_id: str, address: str) -> bool:
        """Whether what serves at ``address`` holds the sandbox's key (read from its Secret once
        per runtime, unless this runtime made it): asked over a fresh nonce, so no earlier
        answer fits. A sandbox without a key Secret (or one made before keys) cannot be
        verified: False."""
        check_sandbox_id(sandbox_id)
        key = self._keys.get(sandbox_id) or await self._read_key(sandbox_id)
        if key is None:
            log.warning("sandbox %s has no agent key Secret: its agent is not trusted", sandbox_id)
            return False
        return await prove(address, key, sandbox_id, self.config.verify_timeout_s) is not None

    async def fork(self, source_id: str, spec: RuntimeSandboxSpec) -> RuntimeSandbox:
        raise RuntimeNotSupported(
            "the kubernetes runtime cannot fork a sandbox: a running Pod's file system cannot "
            "be copied through the Kubernetes API"
        )

    async def delete(self, sandbox_id: str) -> None:
        self._watch()
        check_sandbox_id(sandbox_id)
        async with self._lock(sandbox_id):
            await self._delete_locked(sandbox_id)

    async def _delete_locked(self, sandbox_id: str) -> None:
        self._deleting.add(sandbox_id)
        self._keys.pop(sandbox_id, None)
        try:
            timer = self._expiry_timers.pop(sandbox_id, None)
            if timer is not None:
                timer.cancel()
            self._egress.pop(sandbox_id, None)
            await self._delete_object(
                self._core_api().delete_namespaced_pod(
                    sandbox_id,
                    self.config.namespace,
                    grace_period_seconds=self.config.termination_grace_s,
                    _preload_content=False,
                    _request_timeout=self.config.request_timeout_s,
                )
            )
            await self._delete_policy(sandbox_id)
            await self._write_peer_policies(sandbox_id, ())
            await self._delete_object(
                self._core_api().delete_namespaced_secret(
                    key_secret_name(sandbox_id),
                    self.config.namespace,
                    _preload_content=False,
                    _request_timeout=self.config.request_timeout_s,
                )
            )
            try:
                await self._watch().wait_for(
                    sandbox_id, lambda v: v is None, self.config.delete_timeout_s
                )
            except TimeoutError:
                raise RuntimeFailure(
                    FailureReason.INTERNAL,
                    f"sandbox Pod {sandbox_id} still terminating after "
                    f"{self.config.delete_timeout_s:g} s",
                ) from None
        finally:
            self._deleting.discard(sandbox_id)
            self._reported.discard(sandbox_id)

    @staticmethod
    async def _delete_object(pending: Any) -> None:
        try:
            await call_api(pending)
        except KubeApiError as exc:
            if exc.code != 404:
                raise RuntimeFailure(
                    FailureReason.INTERNAL, f"delete failed: the API server answered {exc}"
                ) from None

    async def status(self, sandbox_id: str) -> SandboxStatus:
        view = self._watch().view(sandbox_id)
        if view is not None:
            return (
                SandboxStatus.RUNNING
                if view.running and not view.deleting
                else (SandboxStatus.EXITED)
            )
        return SandboxStatus.EXITED if sandbox_id in self._policies else SandboxStatus.ABSENT

    async def list_sandboxes(self) -> list[str]:
        """Ids of every sandbox Pod (from the stream's cache), policy and key Secret (one LIST
        each)."""
        pods = self._watch()
        try:
            await self._list_policies(schedule=False)
            secrets = await self._list_key_secrets()
        except KubeApiError as exc:
            raise RuntimeFailure(
                FailureReason.INTERNAL, f"cannot list sandbox policies and secrets: {exc}"
            ) from None
        return sorted(set(pods.names()) | self._policies | secrets)

    async def update_egress(self, sandbox_id: str, egress: Sequence[EgressRule]) -> None:
        """Rewrite (or delete, for none) the sandbox's policy; applied when the API server
        accepted it (the CNI enforces it shortly after)."""
        check_sandbox_id(sandbox_id)
        async with self._lock(sandbox_id):
            view = self._watch().view(sandbox_id)
            if view is None or not view.running:
                raise RuntimeFailure(FailureReason.INTERNAL, f"sandbox {sandbox_id} is not running")
            await self._write_policy(sandbox_id, tuple(egress))

    async def exits(self) -> AsyncIterator[SandboxExit]:
        """Sandboxes whose Pod failed or vanished without a delete. One consumer; ends on
        close."""
        while True:
            event = await self._exits.get()
            if event is None:
                return
            yield event

    # -- images ------------------------------------------------------------------------------

    def image_nodes(self, image: str) -> list[str]:
        """The nodes known to hold ``image`` (empty while image locality is off)."""
        return self._node_images.nodes_with(image) if self._node_images is not None else []

    async def list_nodes(self, selector: Mapping[str, str] | None = None) -> list[str]:
        """The names of the nodes whose labels match ``selector`` (default: the sandbox Pods'
        ``node_selector``)."""
        wanted = self.config.node_selector if selector is None else selector
        label_selector = ",".join(f"{key}={value}" for key, value in sorted(wanted.items()))
        try:
            data = await call_api(
                self._core_api().list_node(
                    label_selector=label_selector,
                    _preload_content=False,
                    _request_timeout=self.config.request_timeout_s,
                )
            )
        except KubeApiError as exc:
            raise RuntimeUnavailable(
                f"cannot list nodes: {exc} (the env chart's ClusterRole grants it with "
                "sandbox.imageLocality.weight > 0)"
            ) from None
        return sorted(
            str((item.get("metadata") or {}).get("name")) for item in data.get("items") or ()
        )

    async def prepull_images(
        self,
        images: Sequence[str],
        nodes: Sequence[str] = (),
        *,
        node_selector: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[PrepullProgress, None]:
        """Pull ``images`` on ``nodes`` (default: every node matching ``node_selector``, by
        default the sandbox pool's) ahead of the sandboxes that will run them; yields the
        progress of every (node, image) pair on each change, the last one with ``finished``.
        A pull that fails (no such image, the node refuses the Pod) is reported, not raised;
        bad arguments raise ValueError, an API server that cannot be used RuntimeUnavailable.
        Close the iterator (``contextlib.aclosing``) to stop early: the Pods are deleted."""
        images = [image.strip() for image in images if image.strip()]
        if not images:
            raise ValueError("name at least one image to pre-pull")
        for image in images:
            if image == "host" or image.startswith(_LOCAL_IMAGES):
                raise ValueError(
                    f"image {image!r} is a local runtime image; the kubernetes runtime pulls "
                    "registry references (e.g. python:3.12-slim)"
                )
        known = await self.list_nodes(node_selector if not nodes else {})
        if nodes:
            missing = sorted(set(nodes) - set(known))
            if missing:
                raise ValueError(f"no such nodes: {', '.join(missing)}")
            chosen = list(dict.fromkeys(nodes))
        else:
            chosen = known
            if not chosen:
                selector = node_selector if node_selector is not None else self.config.node_selector
                raise ValueError(f"no node matches the node selector {dict(selector)}")
        run = ImagePrepull(
            self._core_api(),
            self.config,
            chosen,
            images,
            timeout_s or self.config.prepull_timeout_s,
        )
        try:
            async with contextlib.aclosing(run.progress()) as updates:
                async for progress in updates:
                    yield progress
        except KubeApiError as exc:
            raise RuntimeUnavailable(f"pre-pull failed: the API server answered {exc}") from None

    # -- the stream's changes ----------------------------------------------------------------

    def _on_pod_change(self, name: str, before: PodView | None, after: PodView | None) -> None:
        if after is None and name not in self._creating:
            self._keys.pop(name, None)  # its key went with it (whoever deleted it)
        if name in self._creating or name in self._deleting:
            return
        if after is None:
            if name not in self._reported and before is not None and before.running:
                self._exits.put_nowait(
                    SandboxExit(
                        name,
                        FailureReason.RUNTIME_DIED,
                        "the sandbox Pod was deleted outside Orchard",
                    )
                )
            self._reported.discard(name)
            return
        if after.failure is not None and name not in self._reported:
            self._reported.add(name)
            self._exits.put_nowait(SandboxExit(name, after.failure.reason, after.failure.message))

    # -- agent keys --------------------------------------------------------------------------

    async def _create_key_secret(self, spec: RuntimeSandboxSpec, key: str) -> None:
        manifest = key_secret_manifest(self.config, spec.sandbox_id, key, spec.owner, spec.env)
        try:
            await call_api(
                self._core_api().create_namespaced_secret(
                    self.config.namespace,
                    manifest,  # type: ignore[arg-type]
                    _preload_content=False,
                    _request_timeout=self.config.request_timeout_s,
                )
            )
        except KubeApiError as exc:
            raise _create_failure(exc, f"Secret {key_secret_name(spec.sandbox_id)}") from None

    async def _own_key_secret(self, sandbox_id: str, pod: dict[str, Any]) -> None:
        """Make the Pod the Secret's owner: Kubernetes deletes the key with the Pod, whoever
        deletes it."""
        uid = (pod.get("metadata") or {}).get("uid")
        if not uid:
            return
        owner = {"apiVersion": "v1", "kind": "Pod", "name": sandbox_id, "uid": uid}
        try:
            await call_api(
                self._core_api().patch_namespaced_secret(
                    key_secret_name(sandbox_id),
                    self.config.namespace,
                    {"metadata": {"ownerReferences": [owner]}},  # a strategic merge patch
                    _preload_content=False,
                    _request_timeout=self.config.request_timeout_s,
                )
            )
        except KubeApiError as exc:
            raise _create_failure(exc, f"Secret {key_secret_name(sandbox_id)}") from None

    async def _read_key(self, sandbox_id: str) -> str | None:
        try:
            secret = await call_api(
                self._core_api().read_namespaced_secret(
                    key_secret_name(sandbox_id),
                    self.config.namespace,
                    _preload_content=False,
                    _request_timeout=self.config.request_timeout_s,
                )
            )
        except KubeApiError as exc:
            if exc.code == 404:
                return None
            raise AgentUnreachable(
                f"cannot read the agent key of sandbox {sandbox_id!r}: the API server "
                f"answered {exc}"
            ) from None
        encoded = (secret.get("data") or {}).get(KEY_FIELD)
        if not isinstance(encoded, str):
            return None
        try:
            key = base64.b64decode(encoded, validate=True).decode()
        except ValueError:
            return None
        if key:
            self._keys[sandbox_id] = key
        return key or None

    async def _list_key_secrets(self) -> set[str]:
        data = await call_api(
            self._core_api().list_namespaced_secret(
                self.config.namespace,
                label_selector=sandbox_selector(self.config),
                _preload_content=False,
                _request_timeout=self.config.request_timeout_s,
            )
        )
        return {
            sandbox_id
            for item in data.get("items") or ()
            if (sandbox_id := ((item.get("metadata") or {}).get("labels") or {}).get(LABEL_SANDBOX))
        }

    # -- policies ----------------------------------------------------------------------------

    async def _list_policies(self, *, schedule: bool) -> None:
        data = await call_api(
            self._net_api().list_namespaced_network_policy(
                self.config.namespace,
                label_selector=sandbox_selector(self.config),
                _preload_content=False,
                _request_timeout=self.config.request_timeout_s,
            )
        )
        found = {}
        for item in data.get("items") or ():
            labels = (item.get("metadata") or {}).get("labels") or {}
            if sandbox_id := labels.get(LABEL_SANDBOX):
                found[sandbox_id] = item
            elif source := labels.get(LABEL_PEER_SOURCE):
                self._peer_sources.add(source)
        self._policies = set(found)
        if schedule:
            for sandbox_id, item in found.items():
                rules = tuple(rules_from_policy(item))
                self._egress[sandbox_id] = rules
                self._schedule_expiry(sandbox_id, rules)

    async def _write_policy(self, sandbox_id: str, egress: tuple[EgressRule, ...]) -> None:
        egress = tuple(live_rules(egress))  # expired rules leave the policy and its annotation
        manifest = await policy_manifest(self.config, sandbox_id, egress)
        self._egress[sandbox_id] = egress
        if manifest is None:
            self._egress.pop(sandbox_id, None)
            await self._delete_policy(sandbox_id)
            await self._write_peer_policies(sandbox_id, ())
            return
        net = self._net_api()
        name = policy_name(sandbox_id)
        try:
            if sandbox_id in self._policies:
                try:
                    await call_api(
                        net.replace_namespaced_network_policy(
                            name,
                            self.config.namespace,
                            manifest,  # type: ignore[arg-type]
                            _preload_content=False,
                            _request_timeout=self.config.request_timeout_s,
                        )
                    )
                except KubeApiError as exc:
                    if exc.code != 404:
                        raise
                    self._policies.discard(sandbox_id)
            if sandbox_id not in self._policies:
                await call_api(
                    net.create_namespaced_network_policy(
                        self.config.namespace,
                        manifest,  # type: ignore[arg-type]
                        _preload_content=False,
                        _request_timeout=self.config.request_timeout_s,
                    )
                )
                self._policies.add(sandbox_id)
        except KubeApiError as exc:
            raise _create_failure(exc, f"NetworkPolicy {name}") from None
        await self._write_peer_policies(sandbox_id, egress)
        self._schedule_expiry(sandbox_id, egress)

    async def _write_peer_policies(self, sandbox_id: str, egress: Sequence[EgressRule]) -> None:
        """Make the peers' ingress policies for this sandbox what its live rules say."""
        pods = self._watch()
        uids = {}
        for rule in egress:
            view = pods.view(rule.peer) if rule.peer else None
            if view is not None and not view.deleting:
                uids[rule.peer] = view.uid
        wanted = peer_policies(self.config, sandbox_id, egress, uids)
        if not wanted and sandbox_id not in self._peer_sources:
            return
        self._peer_sources.add(sandbox_id)
        net = self._net_api()
        for name in await self._peer_policy_names(sandbox_id) - set(wanted):
            await self._delete_object(
                net.delete_namespaced_network_policy(
                    name,
                    self.config.namespace,
                    _preload_content=False,
                    _request_timeout=self.config.request_timeout_s,
                )
            )
        for name, manifest in wanted.items():
            try:
                try:
                    await call_api(
                        net.create_namespaced_network_policy(
                            self.config.namespace,
                            manifest,  # type: ignore[arg-type]
                            _preload_content=False,
                            _request_timeout=self.config.request_timeout_s,
                        )
                    )
                except KubeApiError as exc:
                    if exc.code != 409:
                        raise
                    await call_api(
                        net.replace_namespaced_network_policy(
                            name,
                            self.config.namespace,
                            manifest,  # type: ignore[arg-type]
                            _preload_content=False,
                            _request_timeout=self.config.request_timeout_s,
                        )
                    )
            except KubeApiError as exc:
                raise _create_failure(exc, f"NetworkPolicy {name}") from None
        if not wanted:
            self._peer_sources.discard(sandbox_id)

    async def _peer_policy_names(self, sandbox_id: str) -> set[str]:
        data = await call_api(
            self._net_api().list_namespaced_network_policy(
                self.config.namespace,
                label_selector=f"{sandbox_selector(self.config)},{LABEL_PEER_SOURCE}={sandbox_id}",
                _preload_content=False,
                _request_timeout=self.config.request_timeout_s,
            )
        )
        return {str((item.get("metadata") or {}).get("name")) for item in data.get("items") or ()}

    async def _delete_policy(self, sandbox_id: str) -> None:
        await self._delete_object(
            self._net_api().delete_namespaced_network_policy(
                policy_name(sandbox_id),
                self.config.namespace,
                _preload_content=False,
                _request_timeout=self.config.request_timeout_s,
            )
        )
        self._policies.discard(sandbox_id)

    def _schedule_expiry(self, sandbox_id: str, egress: Sequence[EgressRule]) -> None:
        timer = self._expiry_timers.pop(sandbox_id, None)
        if timer is not None:
            timer.cancel()
        now = time.time()
        when = next_expiry(egress, now)
        if len(live_rules(egress, now)) < len(egress):
            when = now  # rules expired while no runtime watched (a restart): rewrite now
        if when is None:
            return
        loop = asyncio.get_running_loop()
        self._expiry_timers[sandbox_id] = loop.call_later(
            max(0.0, when - now), self._start_expiry, sandbox_id
        )

    def _start_expiry(self, sandbox_id: str) -> None:
        self._expiry_timers.pop(sandbox_id, None)
        task = asyncio.create_task(self._expire(sandbox_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _expire(self, sandbox_id: str) -> None:
        async with self._lock(sandbox_id):
            egress = self._egress.get(sandbox_id)
            if egress is None or sandbox_id in self._deleting:
                return
            try:
                await self._write_policy(sandbox_id, egress)
            except (RuntimeFailure, KubeApiError) as exc:
                log.warning("sandbox %s: expiring egress rules failed: %s", sandbox_id, exc)
                self._schedule_expiry(sandbox_id, egress)

    # -- internals ---------------------------------------------------------------------------

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def _watch(self) -> SandboxPodWatch:
        if self._pods is None:
            raise RuntimeError("KubernetesRuntime.start() was not called (or close() was)")
        return self._pods

    def _core_api(self) -> client.CoreV1Api:
        if self._core is None:
            raise RuntimeError("KubernetesRuntime.start() was not called")
        return self._core

    def _net_api(self) -> client.NetworkingV1Api:
        if self._net is None:
            raise RuntimeError("KubernetesRuntime.start() was not called")
        return self._net
