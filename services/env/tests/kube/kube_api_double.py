"""``KubeApiDouble``: a TEST DOUBLE of a Kubernetes API server and of the kubelet of one node.

There is no Kubernetes cluster on the build machine and no API server in the package
registries, so the ``kubernetes`` runtime is tested against this double. It serves, on
127.0.0.1 over HTTP, the real REST and watch protocol of the two resources the runtime uses:

- ``/api/v1/namespaces/{ns}/pods``, ``/api/v1/namespaces/{ns}/secrets`` and
  ``/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies``: create (POST), get, list,
  delete (graceful for Pods), replace (PUT, not Pods), patch (PATCH: a merge patch, of
  metadata only); objects a deleted Pod owns (``ownerReferences``) are deleted with it;
  label selectors (``k=v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``); one resourceVersion
  counter over both resources (like etcd's revision); ``Status`` objects for errors (404
  NotFound, 409 AlreadyExists, 422 Invalid, 400 BadRequest);
- watches (``?watch=1``): from a ``resourceVersion`` (every change after it) or from now with the
  current objects as ADDED first; ``timeoutSeconds``; ``allowWatchBookmarks`` → BOOKMARK events;
  a resourceVersion older than the retained history → an ERROR event carrying a 410 ``Expired``
  Status, as the real server sends.

and ``/api/v1/nodes`` (cluster-scoped: list, watch, get), the nodes tests add with the images
they hold (``add_node``). While there are nodes, the double binds each Pod to one, as a minimal
scheduler: ``spec.nodeName`` if set, else the nodes passing its ``nodeSelector`` and required
node affinity (``matchExpressions`` on labels, ``matchFields`` on ``metadata.name``), the one
with the highest sum of matching preferred-affinity weights (ties: the first by name); none
passing leaves the Pod Pending with ``PodScheduled=False, Unschedulable``. A container that
starts puts its image in its node's ``status.images``, as a kubelet reports a pulled image.

It also plays the kubelet for every Pod: each container runs as local processes in fresh mount,
pid and uts namespaces over an overlay of the image's root directory (a catalog of
``ImageDouble`` entries stands in for a registry: an unknown image is ``ErrImagePull``), with
``emptyDir`` volumes bind-mounted, ``$(VAR)`` expansion, the ``status.podIP`` downward API and
``secretKeyRef`` variables (a missing Secret is ``CreateContainerConfigError``), and the
container's ``securityContext`` capabilities (a container runtime's default set, less ``drop``,
plus ``add``) and ``allowPrivilegeEscalation: false`` (no_new_privs), through ``setpriv``.
The Pod IP is a distinct loopback address (127.x.y.z) in the host's network namespace, and the
Pod turns Ready when its readiness probe's gRPC health check answers SERVING. Tests can end
watches, expire history (410), kill a container (also without the kubelet noticing), evict
or preempt a Pod, and refuse every list and watch of a resource with 403 (``forbidden``), as RBAC
would.

What it does not do (only a real cluster can confirm it): scheduling beyond the above (taints,
resources, spreading, the scheduler's own scores), real image pulls, cgroup
limits, network namespaces and NetworkPolicy enforcement (a CNI's job), RBAC, admission,
server-side apply, field selectors, pagination.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import os
import random
import re
import shlex
import shutil
import signal
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["ImageDouble", "KubeApiDouble"]

Obj = dict[str, Any]

_RESOURCES = {
    "pods": ("v1", "Pod"),
    "secrets": ("v1", "Secret"),
    "networkpolicies": ("networking.k8s.io/v1", "NetworkPolicy"),
    "nodes": ("v1", "Node"),
}
_CLUSTER_SCOPED = {"nodes"}
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
# What a container runtime (containerd, CRI-O) grants a container by default.
_DEFAULT_CAPABILITIES = (
    "audit_write",
    "chown",
    "dac_override",
    "fowner",
    "fsetid",
    "kill",
    "mknod",
    "net_bind_service",
    "net_raw",
    "setfcap",
    "setgid",
    "setpcap",
    "setuid",
    "sys_chroot",
)
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


@dataclass(frozen=True)
class ImageDouble:
    """An image the double can run: root directories (upper first) and its config."""

    layers: tuple[Path, ...]
    env: Mapping[str, str] = field(
        default_factory=lambda: {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}
    )
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _status(code: int, reason: str, message: str, **details: Any) -> web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": details,
        "code": code,
    }
    return web.json_response(body, status=code)


def parse_selector(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """``k=v,k!=v,k,!k,k in (a,b),k notin (a)`` as (key, op, values)."""
    terms: list[tuple[str, str, tuple[str, ...]]] = []
    for raw in re.split(r",(?![^()]*\))", text.strip()) if text.strip() else []:
        term = raw.strip()
        if match := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", term):
            values = tuple(v.strip() for v in match.group(3).split(","))
            terms.append((match.group(1), match.group(2), values))
        elif match := re.fullmatch(r"([\w./-]+)\s*(==|=|!=)\s*([\w.-]*)", term):
            op = "!=" if match.group(2) == "!=" else "="
            terms.append((match.group(1), op, (match.group(3),)))
        elif match := re.fullmatch(r"(!?)([\w./-]+)", term):
            terms.append((match.group(2), "!" if match.group(1) else "exists", ()))
        else:
            raise ValueError(f"unable to parse requirement: {term!r}")
    return terms


def selector_matches(
    terms: Sequence[tuple[str, str, tuple[str, ...]]], labels: Mapping[str, str]
) -> bool:
    for key, op, values in terms:
        present = key in labels
        if op == "=" and labels.get(key) != values[0]:
            return False
        if op == "!=" and present and labels[key] == values[0]:
            return False
        if op == "exists" and not present:
            return False
        if op == "!" and present:
            return False
        if op == "in" and labels.get(key) not in values:
            return False
        if op == "notin" and present and labels[key] in values:
            return False
    return True


@dataclass(eq=False)
class _Watcher:
    resource: str
    namespace: str
    selector: list[tuple[str, str, tuple[str, ...]]]
    queue: asyncio.Queue[tuple[str, Obj] | None] = field(default_factory=asyncio.Queue)

    def wants(self, resource: str, obj: Obj) -> bool:
        metadata = obj["metadata"]
        return (
            resource == self.resource
            and metadata.get("namespace", "") == self.namespace
            and selector_matches(self.selector, metadata.get("labels") or {})
        )


@dataclass
class _Container:
    name: str
    outer: asyncio.subprocess.Process
    init_pid: int | None = None

    def signal(self, signum: int) -> None:
        for pid in (self.init_pid, self.outer.pid if signum == signal.SIGKILL else None):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)


@dataclass
class _PodRun:
    key: tuple[str, str]
    directory: Path
    ip: str
    node: str = ""
    task: asyncio.Task[None] | None = None
    containers: dict[str, _Container] = field(default_factory=dict)
    disrupted: bool = False
    unnoticed: bool = False  # container exits leave the Pod's status as it was


class KubeApiDouble:
    """A TEST DOUBLE of the Kubernetes API server and kubelet (see the module docstring)."""

    def __init__(
        self,
        base_dir: Path,
        images: Mapping[str, ImageDouble],
        *,
        bookmark_interval_s: float = 0.5,
        probe_interval_s: float = 0.05,
    ) -> None:
        self.base_dir = Path(base_dir)
        self.images = dict(images)
        self.bookmark_interval_s = bookmark_interval_s
        self.probe_interval_s = probe_interval_s
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.forbidden: set[str] = set()  # resources whose list and watch are 403 (RBAC)
        self._objects: dict[tuple[str, str, str], Obj] = {}
        self._rv = 1
        self._history: list[tuple[int, str, str, Obj]] = []
        self._oldest_rv = 1  # a watch from below this resourceVersion is 410 Expired
        self._watchers: set[_Watcher] = set()
        self._runs: dict[tuple[str, str], _PodRun] = {}
        self._ip_prefix = f"127.{random.randint(100, 199)}"
        self._next_ip = 0
        self._runner: web.AppRunner | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.url = ""

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> KubeApiDouble:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> str:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        app = web.Application()
        for resource in _RESOURCES:
            base = self._path(resource)
            app.router.add_get(base, self._list_or_watch(resource))
            if resource in _CLUSTER_SCOPED:
                app.router.add_get(base + "/{name}", self._get(resource))
                continue
            app.router.add_post(base, self._create(resource))
            app.router.add_get(base + "/{name}", self._get(resource))
            app.router.add_delete(base + "/{name}", self._delete(resource))
            app.router.add_put(base + "/{name}", self._replace(resource))
            app.router.add_patch(base + "/{name}", self._patch(resource))
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        """Stop every Pod's processes, end every watch, stop serving."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for key in list(self._runs):
            await self._stop_pod(key, grace_s=0)
        self.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @staticmethod
    def _path(resource: str) -> str:
        group_version = _RESOURCES[resource][0]
        prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        if resource in _CLUSTER_SCOPED:
            return f"{prefix}/{resource}"
        return f"{prefix}/namespaces/{{namespace}}/{resource}"

    # -- what tests use ----------------------------------------------------------------------

    def objects(self, resource: str, namespace: str) -> list[Obj]:
        return [
            copy.deepcopy(obj)
            for (kind, ns, _), obj in sorted(self._objects.items())
            if kind == resource and ns == namespace
        ]

    def get(self, resource: str, namespace: str, name: str) -> Obj | None:
        obj = self._objects.get((resource, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def add_node(
        self, name: str, labels: Mapping[str, str] | None = None, images: Sequence[str] = ()
    ) -> None:
        """A node, with the images it holds (``status.images``, one name each)."""
        node = {
            "metadata": {
                "name": name,
                "labels": {"kubernetes.io/hostname": name, **(labels or {})},
            },
            "spec": {},
            "status": {"images": [{"names": [image], "sizeBytes": 1 << 20} for image in images]},
        }
        self._store("nodes", "ADDED", self._admit("nodes", node))

    def node_images(self, name: str) -> list[str]:
        node = self._objects.get(("nodes", "", name)) or {}
        return [n for image in node.get("status", {}).get("images", []) for n in image["names"]]

    def put_object(self, resource: str, obj: Obj) -> None:
        """Store an object as another client would (no kubelet run): for orphan tests."""
        self._store(resource, "ADDED", self._admit(resource, obj))

    def count(self, method: str, path_suffix: str = "", **query: str) -> int:
        """Requests seen with this method, path ending and query values."""
        return sum(
            1
            for m, path, q in self.requests
            if m == method
            and path.endswith(path_suffix)
            and all(q.get(k) == v for k, v in query.items())
        )

    def end_watches(self) -> None:
        """End every open watch stream normally (as a server-side timeout does)."""
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(None)

    def expire_history(self) -> None:
        """Forget every event so far: a watch from an older resourceVersion gets 410, and each
        open stream gets the ERROR event a lagging watcher gets from a real server."""
        self._oldest_rv = self._rv + 1
        self._history.clear()
        expired = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": "too old resource version",
            "reason": "Expired",
            "code": 410,
        }
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(("ERROR", expired))
            watcher.queue.put_nowait(None)

    def kill_container(
        self, namespace: str, name: str, container: str = "sandbox", *, noticed: bool = True
    ) -> None:
        """SIGKILL a container's first process, as a crash would. ``noticed=False``: the Pod's
        status stays as it was (Running, Ready), as while a kubelet has not noticed yet or a
        process of the Pod outlived the first one."""
        run = self._runs[(namespace, name)]
        run.unnoticed = run.unnoticed or not noticed
        run.containers[container].signal(signal.SIGKILL)

    async def disrupt(self, namespace: str, name: str, reason: str, message: str = "") -> None:
        """Evict (``Evicted``) or preempt (``Preempted``) a running Pod: its containers are
        killed and it ends ``Failed`` with that reason, a DisruptionTarget condition, and stays
        (as a kubelet-evicted Pod does) until someone deletes it."""
        key = (namespace, name)
        run = self._runs[key]
        run.disrupted = True
        for container in run.containers.values():
            container.signal(signal.SIGKILL)
        if run.task is not None:
            run.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run.task
        target = {"Evicted": "TerminationByKubelet", "Preempted": "PreemptionByScheduler"}

        def change(status: Obj) -> None:
            status["phase"] = "Failed"
            status["reason"] = reason
            status["message"] = message or f"The pod was {reason.lower()} (test double)"
            self._condition(status, "Ready", "False", "PodFailed")
            self._condition(status, "DisruptionTarget", "True", target.get(reason, reason))
            for state in status.get("containerStatuses") or ():
                if "running" in state["state"]:
                    state["state"] = {"terminated": {"exitCode": 137, "reason": "Error"}}
                state["ready"] = False

        self._update_status(key, change)

    # -- the store ---------------------------------------------------------------------------

    def _bump(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _store(self, resource: str, kind: str, obj: Obj) -> None:
        metadata = obj["metadata"]
        key = (resource, metadata.get("namespace", ""), metadata["name"])
        rv = int(metadata["resourceVersion"])
        if kind == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        frozen = copy.deepcopy(obj)
        self._history.append((rv, resource, kind, frozen))
        for watcher in list(self._watchers):
            if watcher.wants(resource, frozen):
                watcher.queue.put_nowait((kind, frozen))

    def _admit(self, resource: str, obj: Obj) -> Obj:
        api_version, kind = _RESOURCES[resource]
        obj = copy.deepcopy(obj)
        obj.setdefault("apiVersion", api_version)
        obj.setdefault("kind", kind)
        metadata = obj.setdefault("metadata", {})
        metadata["uid"] = str(uuid.uuid4())
        metadata["creationTimestamp"] = _now()
        metadata["resourceVersion"] = self._bump()
        if resource == "pods":
            obj["status"] = {"phase": "Pending", "conditions": []}
        return obj

    def _update_status(self, key: tuple[str, str], change: Any) -> None:
        obj = self._objects.get(("pods", *key))
        if obj is None:
            return
        obj = copy.deepcopy(obj)
        change(obj["status"])
        obj["metadata"]["resourceVersion"] = self._bump()
        self._store("pods", "MODIFIED", obj)

    @staticmethod
    def _condition(status: Obj, kind: str, value: str, reason: str = "") -> None:
        conditions = [c for c in status.setdefault("conditions", []) if c["type"] != kind]
        entry = {"type": kind, "status": value, "lastTransitionTime": _now()}
        if reason:
            entry["reason"] = reason
        conditions.append(entry)
        status["conditions"] = conditions

    # -- handlers ----------------------------------------------------------------------------

    def _log(self, request: web.Request) -> None:
        self.requests.append((request.method, request.path, dict(request.query)))

    def _list_or_watch(self, resource: str) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            self._log(request)
            if resource in self.forbidden:
                return _status(
                    403, "Forbidden", f'{resource} is forbidden: cannot list resource "{resource}"'
                )
            namespace = request.match_info.get("namespace", "")
            try:
                selector = parse_selector(request.query.get("labelSelector", ""))
            except ValueError as exc:
                return _status(400, "BadRequest", str(exc))
            if request.query.get("fieldSelector"):
                return _status(400, "BadRequest", "the test double has no field selectors")
            if request.query.get("watch") in ("1", "true", "True"):
                return await self._watch(request, resource, namespace, selector)
            api_version, kind = _RESOURCES[resource]
            items = [
                copy.deepcopy(obj)
                for (r, ns, _), obj in sorted(self._objects.items())
                if r == resource
                and ns == namespace
                and selector_matches(selector, obj["metadata"].get("labels") or {})
            ]
            return web.json_response(
                {
                    "kind": f"{kind}List",
                    "apiVersion": api_version,
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": items,
                }
            )

        return handler

    async def _watch(
        self,
        request: web.Request,
        resource: str,
        namespace: str,
        selector: list[tuple[str, str, tuple[str, ...]]],
    ) -> web.StreamResponse:
        since = request.query.get("resourceVersion", "")
        bookmarks = request.query.get("allowWatchBookmarks") in ("true", "1", "True")
        timeout_s = float(request.query.get("timeoutSeconds", "1800"))
        watcher = _Watcher(resource, namespace, selector)
        backlog: list[tuple[str, Obj]] = []
        if since in ("", "0"):
            backlog = [
                ("ADDED", copy.deepcopy(obj))
                for (r, ns, _), obj in sorted(self._objects.items())
                if watcher.wants(r, obj)
            ]
        elif int(since) + 1 < self._oldest_rv:
            backlog = [("ERROR", _expired_status(since))]
        else:
            backlog = [
                (kind, obj)
                for rv, r, kind, obj in self._history
                if rv > int(since) and watcher.wants(r, obj)
            ]
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        expired = any(kind == "ERROR" for kind, _ in backlog)
        self._watchers.add(watcher)
        deadline = time.monotonic() + timeout_s
        try:
            for kind, obj in backlog:
                await response.write(_line(kind, obj))
            while not expired:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wait = min(left, self.bookmark_interval_s) if bookmarks else left
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), wait)
                except TimeoutError:
                    if bookmarks and time.monotonic() < deadline:
                        api_version, kind_name = _RESOURCES[resource]
                        mark = {
                            "kind": kind_name,
                            "apiVersion": api_version,
                            "metadata": {"resourceVersion": str(self._rv)},
                        }
                        await response.write(_line("BOOKMARK", mark))
                    continue
                if item is None:
                    break
                await response.write(_line(*item))
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.discard(watcher)
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    def _create(self, resource: str) -> Any:
        async def handler(request: web.Request) -> web.Response:
            self._log(request)
            namespace = request.match_info.get("namespace", "")
            try:
                body = await request.json()
            except ValueError:
                return _status(400, "BadRequest", "the body is not JSON")
            problem = self._invalid(resource, namespace, body)
            if problem:
                return _status(422, "Invalid", problem)
            name = body["metadata"]["name"]
            if (resource, namespace, name) in self._objects:
                kind = _RESOURCES[resource][1]
                return (
                    _status(
                        409,
                        "AlreadyExists",
                        f'{resource} "{name}" already exists',
                        name=name,
                        kind=resource,
                    )
                    if kind
                    else _status(409, "AlreadyExists", name)
                )
            body["metadata"]["namespace"] = namespace
            obj = self._admit(resource, body)
            self._store(resource, "ADDED", obj)
            if resource == "pods":
                self._start_pod((namespace, name))
            return web.json_response(copy.deepcopy(obj), status=201)

        return handler

    def _invalid(self, resource: str, namespace: str, body: Any) -> str:
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            return "metadata: Required value"
        metadata = body["metadata"]
        name = metadata.get("name", "")
        names = _DNS_SUBDOMAIN if resource == "secrets" else _DNS_LABEL
        if not isinstance(name, str) or not names.fullmatch(name):
            return f"metadata.name: Invalid value: {name!r}: not a lowercase RFC 1123 name"
        if metadata.get("namespace") not in (None, namespace):
            return "metadata.namespace: does not match the namespace of the request"
        kind = _RESOURCES[resource][1]
        if body.get("kind") not in (None, kind):
            return f"kind: must be {kind}"
        if resource == "secrets":
            return _invalid_secret_data(body.get("data"))
        spec = body.get("spec")
        if not isinstance(spec, dict):
            return "spec: Required value"
        if resource == "pods":
            containers = spec.get("containers")
            if not containers:
                return "spec.containers: Required value"
            for index, container in enumerate([*spec.get("initContainers", []), *containers]):
                if not container.get("name") or not container.get("image"):
                    return f"spec.containers[{index}]: name and image are required"
        elif "podSelector" not in spec:
            return "spec.podSelector: Required value"
        return ""

    def _get(self, resource: str) -> Any:
        async def handler(request: web.Request) -> web.Response:
            self._log(request)
            namespace, name = request.match_info.get("namespace", ""), request.match_info["name"]
            obj = self._objects.get((resource, namespace, name))
            if obj is None:
                return _not_found(resource, name)
            return web.json_response(copy.deepcopy(obj))

        return handler

    def _replace(self, resource: str) -> Any:
        async def handler(request: web.Request) -> web.Response:
            self._log(request)
            namespace, name = request.match_info.get("namespace", ""), request.match_info["name"]
            if resource == "pods":
                return _status(422, "Invalid", "the test double does not replace Pods")
            current = self._objects.get((resource, namespace, name))
            if current is None:
                return _not_found(resource, name)
            body = await request.json()
            problem = self._invalid(resource, namespace, body)
            if problem or body["metadata"]["name"] != name:
                return _status(422, "Invalid", problem or "metadata.name: must match the path")
            sent_rv = body["metadata"].get("resourceVersion")
            if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
                return _status(409, "Conflict", "the object has been modified", name=name)
            obj = copy.deepcopy(body)
            obj["apiVersion"], obj["kind"] = _RESOURCES[resource]
            for kept in ("uid", "creationTimestamp"):
                obj["metadata"][kept] = current["metadata"][kept]
            obj["metadata"]["namespace"] = namespace
            obj["metadata"]["resourceVersion"] = self._bump()
            self._store(resource, "MODIFIED", obj)
            return web.json_response(copy.deepcopy(obj))

        return handler

    def _patch(self, resource: str) -> Any:
        async def handler(request: web.Request) -> web.Response:
            self._log(request)
            namespace, name = request.match_info.get("namespace", ""), request.match_info["name"]
            current = self._objects.get((resource, namespace, name))
            if current is None:
                return _not_found(resource, name)
            try:
                body = await request.json()
            except ValueError:
                return _status(400, "BadRequest", "the body is not JSON")
            if not isinstance(body, dict) or set(body) - {"metadata"}:
                return _status(422, "Invalid", "the test double patches metadata only")
            obj = copy.deepcopy(current)
            for key, value in (body.get("metadata") or {}).items():
                if key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp"):
                    continue
                if value is None:
                    obj["metadata"].pop(key, None)
                else:
                    obj["metadata"][key] = copy.deepcopy(value)
            obj["metadata"]["resourceVersion"] = self._bump()
            self._store(resource, "MODIFIED", obj)
            return web.json_response(copy.deepcopy(obj))

        return handler

    def _delete(self, resource: str) -> Any:
        async def handler(request: web.Request) -> web.Response:
            self._log(request)
            namespace, name = request.match_info.get("namespace", ""), request.match_info["name"]
            obj = self._objects.get((resource, namespace, name))
            if obj is None:
                return _not_found(resource, name)
            if resource != "pods":
                gone = copy.deepcopy(obj)
                gone["metadata"]["resourceVersion"] = self._bump()
                self._store(resource, "DELETED", gone)
                return web.json_response(
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Success",
                        "details": {"name": name, "kind": resource},
                    }
                )
            body = await request.read()
            grace = _grace(request.query.get("gracePeriodSeconds"), body, obj)
            if not obj["metadata"].get("deletionTimestamp"):
                marked = copy.deepcopy(obj)
                marked["metadata"]["deletionTimestamp"] = _now()
                marked["metadata"]["deletionGracePeriodSeconds"] = grace
                marked["metadata"]["resourceVersion"] = self._bump()
                self._store(resource, "MODIFIED", marked)
                task = asyncio.create_task(self._finish_delete((namespace, name), grace))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
                obj = marked
            return web.json_response(copy.deepcopy(obj))

        return handler

    async def _finish_delete(self, key: tuple[str, str], grace_s: int) -> None:
        await self._stop_pod(key, grace_s)
        obj = self._objects.get(("pods", *key))
        if obj is not None:
            gone = copy.deepcopy(obj)
            gone["metadata"]["resourceVersion"] = self._bump()
            self._store("pods", "DELETED", gone)
            self._collect_owned(key[0], obj["metadata"]["uid"])

    def _collect_owned(self, namespace: str, owner_uid: str) -> None:
        """The garbage collector: delete what the deleted object owned."""
        for (resource, ns, _), obj in list(self._objects.items()):
            owners = obj["metadata"].get("ownerReferences") or ()
            if ns == namespace and any(o.get("uid") == owner_uid for o in owners):
                gone = copy.deepcopy(obj)
                gone["metadata"]["resourceVersion"] = self._bump()
                self._store(resource, "DELETED", gone)

    # -- the kubelet -------------------------------------------------------------------------

    def _start_pod(self, key: tuple[str, str]) -> None:
        self._next_ip += 1
        ip = f"{self._ip_prefix}.{self._next_ip // 250}.{self._next_ip % 250 + 1}"
        run = _PodRun(key, self.base_dir / "pods" / f"{key[0]}-{key[1]}-{uuid.uuid4().hex[:6]}", ip)
        self._runs[key] = run
        run.task = asyncio.create_task(self._run_pod(run))

    async def _stop_pod(self, key: tuple[str, str], grace_s: int) -> None:
        run = self._runs.get(key)
        if run is None:
            return
        if run.task is not None:
            run.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run.task
        for container in run.containers.values():
            container.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for container in run.containers.values():
            left = max(0.0, deadline - time.monotonic())
            try:
                await asyncio.wait_for(container.outer.wait(), left)
            except TimeoutError:
                container.signal(signal.SIGKILL)
                await container.outer.wait()
        self._runs.pop(key, None)
        await asyncio.to_thread(shutil.rmtree, run.directory, True)

    def _bind(self, run: _PodRun) -> bool:
        """Choose the Pod's node (see the module docstring); False: it is unschedulable."""
        nodes = [obj for (r, _, _), obj in sorted(self._objects.items()) if r == "nodes"]
        if not nodes:
            return True
        pod = self._objects[("pods", *run.key)]
        spec = pod["spec"]
        fits = [n for n in nodes if _node_fits(spec, n)]
        if not fits:

            def unschedulable(status: Obj) -> None:
                self._condition(status, "PodScheduled", "False", "Unschedulable")
                status["conditions"][-1]["message"] = (
                    f"0/{len(nodes)} nodes are available: {len(nodes)} node(s) didn't match "
                    "Pod's node affinity/selector."
                )

            self._update_status(run.key, unschedulable)
            return False
        best = max(fits, key=lambda n: (_preference(spec, n), -fits.index(n)))
        run.node = best["metadata"]["name"]
        bound = copy.deepcopy(pod)
        bound["spec"]["nodeName"] = run.node
        bound["metadata"]["resourceVersion"] = self._bump()
        self._store("pods", "MODIFIED", bound)
        return True

    def _pulled(self, node: str, image: str) -> None:
        """The kubelet reports an image it pulled in its Node's status."""
        obj = self._objects.get(("nodes", "", node))
        if obj is None or image in self.node_images(node):
            return
        obj = copy.deepcopy(obj)
        obj["status"].setdefault("images", []).append({"names": [image], "sizeBytes": 1 << 20})
        obj["metadata"]["resourceVersion"] = self._bump()
        self._store("nodes", "MODIFIED", obj)

    async def _run_pod(self, run: _PodRun) -> None:
        namespace, name = run.key
        if not self._bind(run):
            return
        pod = self._objects[("pods", namespace, name)]
        spec = pod["spec"]
        run.directory.mkdir(parents=True)
        volumes: dict[str, Path] = {}
        for volume in spec.get("volumes") or ():
            if "emptyDir" in volume:
                path = run.directory / "volumes" / volume["name"]
                path.mkdir(parents=True)
                path.chmod(0o777)
                volumes[volume["name"]] = path

        def scheduled(status: Obj) -> None:
            status.update(
                podIP=run.ip, podIPs=[{"ip": run.ip}], hostIP="127.0.0.1", startTime=_now()
            )
            self._condition(status, "PodScheduled", "True")
            self._condition(status, "Initialized", "False", "ContainersNotInitialized")
            self._condition(status, "Ready", "False", "ContainersNotReady")
            status["initContainerStatuses"] = [
                _waiting(c, "PodInitializing") for c in spec.get("initContainers") or ()
            ]
            status["containerStatuses"] = [
                _waiting(c, "PodInitializing") for c in spec["containers"]
            ]

        self._update_status(run.key, scheduled)
        for index, container in enumerate(spec.get("initContainers") or ()):
            started = await self._start_container(
                run, pod, container, volumes, where="initContainerStatuses", index=index
            )
            if started is None:
                return
            code = await _exit_code(started.outer)
            self._set_state(
                run.key,
                "initContainerStatuses",
                index,
                _terminated(code, run.directory / container["name"]),
            )
            if code != 0:
                self._update_status(run.key, lambda s: s.update(phase="Failed"))
                return
        self._update_status(run.key, lambda s: self._condition(s, "Initialized", "True"))
        started_all = []
        for index, container in enumerate(spec["containers"]):
            started = await self._start_container(
                run, pod, container, volumes, where="containerStatuses", index=index
            )
            if started is None:
                return
            started_all.append((index, container, started))
        self._update_status(run.key, lambda s: s.update(phase="Running"))
        await self._probe_until_exit(run, started_all)

    async def _probe_until_exit(
        self, run: _PodRun, started: list[tuple[int, Obj, _Container]]
    ) -> None:
        ready = False
        exits = {asyncio.ensure_future(c.outer.wait()): (i, c) for i, _, c in started}
        probes = [
            (c.get("readinessProbe") or {}).get("grpc", {}).get("port") for _, c, _ in started
        ]
        try:
            while exits:
                if not ready and all(
                    [await self._serving(run.ip, port) for port in probes if port]
                ):
                    ready = True

                    def mark_ready(status: Obj) -> None:
                        self._condition(status, "ContainersReady", "True")
                        self._condition(status, "Ready", "True")
                        for state in status["containerStatuses"]:
                            state["ready"] = True

                    self._update_status(run.key, mark_ready)
                done, _ = await asyncio.wait(
                    exits,
                    timeout=self.probe_interval_s if not ready else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for future in done:
                    index, container = exits.pop(future)
                    code = await _exit_code(container.outer)
                    self._container_exited(run, index, code)
        finally:
            for future in exits:
                future.cancel()

    def _container_exited(self, run: _PodRun, index: int, code: int) -> None:
        if run.disrupted or run.unnoticed:
            return

        def change(status: Obj) -> None:
            state = status["containerStatuses"][index]
            name = state["name"]
            state["state"] = _terminated(code, run.directory / name)
            state["ready"] = False
            self._condition(status, "Ready", "False", "PodCompleted" if code == 0 else "PodFailed")
            self._condition(status, "ContainersReady", "False")
            status["phase"] = "Succeeded" if code == 0 else "Failed"

        self._update_status(run.key, change)

    @staticmethod
    async def _serving(ip: str, port: int) -> bool:
        async with grpc.aio.insecure_channel(f"{ip}:{port}") as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=0.5
                )
            except grpc.aio.AioRpcError:
                return False
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def _set_state(self, key: tuple[str, str], where: str, index: int, state: Obj) -> None:
        def change(status: Obj) -> None:
            status[where][index]["state"] = state

        self._update_status(key, change)

    async def _start_container(
        self,
        run: _PodRun,
        pod: Obj,
        container: Obj,
        volumes: Mapping[str, Path],
        *,
        where: str,
        index: int,
    ) -> _Container | None:
        image = self.images.get(container["image"])
        if image is None:
            message = (
                f'Failed to pull image "{container["image"]}": not found in the test double\'s '
                "image catalog"
            )
            self._set_state(
                run.key, where, index, {"waiting": {"reason": "ErrImagePull", "message": message}}
            )
            return None
        env = dict(image.env)
        for entry in container.get("env") or ():
            source = entry.get("valueFrom") or {}
            if "value" in entry:
                env[entry["name"]] = _expand(entry["value"], env)
            elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                env[entry["name"]] = run.ip
            elif "secretKeyRef" in source:
                value = self._secret_value(run.key[0], source["secretKeyRef"])
                if value is None:
                    ref = source["secretKeyRef"]
                    message = f'secret "{ref.get("name")}" not found (or no key {ref.get("key")})'
                    self._set_state(
                        run.key,
                        where,
                        index,
                        {"waiting": {"reason": "CreateContainerConfigError", "message": message}},
                    )
                    return None
                env[entry["name"]] = value
        env["HOSTNAME"] = pod["metadata"]["name"]
        # Kubernetes: `command` replaces the entrypoint and drops the image's CMD; `args` alone
        # replaces only the CMD.
        if "command" in container:
            words = [*container["command"], *(container.get("args") or ())]
        else:
            words = [*image.entrypoint, *container.get("args", image.cmd)]
        argv = [_expand(a, env) for a in words]
        working_dir = container.get("workingDir") or "/"
        home = run.directory / container["name"]
        for part in ("upper", "work", "root"):
            (home / part).mkdir(parents=True)
        lower = ":".join(str(layer) for layer in image.layers)
        root = home / "root"
        lines = [
            "set -e",
            f"mount -t overlay overlay -o lowerdir={lower},upperdir={home / 'upper'},"
            f"workdir={home / 'work'} {root}",
            f"mkdir -p {root}/proc {root}/dev {root}/tmp",
            f"mount -t proc proc {root}/proc",
            f"mount -t tmpfs -o mode=755 tmpfs {root}/dev",
        ]
        for device in _DEVICES:
            lines.append(
                f"touch {root}/dev/{device} && mount --bind /dev/{device} {root}/dev/{device}"
            )
        for mount in container.get("volumeMounts") or ():
            source = volumes[mount["name"]]
            target = shlex.quote(f"{root}{mount['mountPath']}")
            lines.append(f"mkdir -p {target} && mount --bind {source} {target}")
            if mount.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {target}")
        lines += [
            f"hostname {shlex.quote(pod['metadata']['name'])}",
            f"mkdir -p {shlex.quote(f'{root}{working_dir}')}",
            "exec "
            + " ".join(shlex.quote(a) for a in _privilege_args(container))
            + f" unshare --root={root} --wd={shlex.quote(working_dir)} -- "
            + " ".join(shlex.quote(a) for a in argv),
        ]
        script = home / "start.sh"
        script.write_text("\n".join(lines) + "\n")
        log = open(home / "log", "wb")  # noqa: SIM115 - handed to the child
        try:
            outer = await asyncio.create_subprocess_exec(
                "unshare",
                "--mount",
                "--uts",
                "--pid",
                "--fork",
                "--kill-child",
                "/bin/sh",
                str(script),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        finally:
            log.close()
        started = _Container(container["name"], outer)
        run.containers[container["name"]] = started
        if run.node:
            self._pulled(run.node, container["image"])
        started.init_pid = await _first_child(outer)
        self._set_state(run.key, where, index, {"running": {"startedAt": _now()}})
        return started

    def _secret_value(self, namespace: str, ref: Obj) -> str | None:
        secret = self._objects.get(("secrets", namespace, str(ref.get("name"))))
        encoded = ((secret or {}).get("data") or {}).get(ref.get("key"))
        return base64.b64decode(encoded).decode() if isinstance(encoded, str) else None


def _term_matches(term: Obj, node: Obj) -> bool:
    """One NodeSelectorTerm: every expression (on labels) and field (``metadata.name``) holds."""
    labels = node["metadata"].get("labels") or {}
    checks = [(labels, e) for e in term.get("matchExpressions") or ()]
    fields = {"metadata.name": node["metadata"]["name"]}
    checks += [(fields, f) for f in term.get("matchFields") or ()]
    for values, expression in checks:
        key, op = expression["key"], expression["operator"]
        wanted = expression.get("values") or ()
        present = key in values
        if (
            (op == "In" and values.get(key) not in wanted)
            or (op == "NotIn" and present and values[key] in wanted)
            or (op == "Exists" and not present)
            or (op == "DoesNotExist" and present)
        ):
            return False
    return True


def _node_fits(spec: Obj, node: Obj) -> bool:
    if spec.get("nodeName"):
        return bool(spec["nodeName"] == node["metadata"]["name"])
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms") or ()
    return not terms or any(_term_matches(term, node) for term in terms)


def _preference(spec: Obj, node: Obj) -> int:
    affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
    preferred = affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or ()
    return sum(int(p["weight"]) for p in preferred if _term_matches(p["preference"], node))


def _privilege_args(container: Obj) -> list[str]:
    """``setpriv`` with the container's capabilities (the runtime's default set, less
    ``drop``, plus ``add``) and no_new_privs unless privilege escalation is allowed. It keeps
    CAP_SYS_CHROOT for the ``unshare --root`` that follows (a real runtime needs none)."""
    context = container.get("securityContext") or {}
    asked = context.get("capabilities") or {}
    drop = {str(c).lower() for c in asked.get("drop") or ()}
    keep = set() if "all" in drop else set(_DEFAULT_CAPABILITIES) - drop
    keep |= {str(c).lower() for c in asked.get("add") or ()}
    keep.add("sys_chroot")
    args = ["setpriv", "--bounding-set", ",".join(["-all", *(f"+{c}" for c in sorted(keep))])]
    args += ["--inh-caps", "-all"]
    if context.get("allowPrivilegeEscalation") is False:
        args.append("--no-new-privs")
    return [*args, "--"]


def _invalid_secret_data(data: Any) -> str:
    if data is None:
        return ""
    if not isinstance(data, dict):
        return "data: must be a map"
    for key, value in data.items():
        try:
            base64.b64decode(value, validate=True)
        except (TypeError, ValueError):
            return f"data[{key}]: not base64"
    return ""


def _line(kind: str, obj: Obj) -> bytes:
    return (json.dumps({"type": kind, "object": obj}) + "\n").encode()


def _expired_status(since: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f"too old resource version: {since}",
        "reason": "Expired",
        "code": 410,
    }


def _not_found(resource: str, name: str) -> web.Response:
    return _status(404, "NotFound", f'{resource} "{name}" not found', name=name, kind=resource)


def _grace(query_value: str | None, body: bytes, obj: Obj) -> int:
    value: Any = query_value
    if value is None and body:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            value = json.loads(body).get("gracePeriodSeconds")
    if value is None:
        value = obj["spec"].get("terminationGracePeriodSeconds", 30)
    return int(value)


def _terminated(code: int, home: Path) -> Obj:
    """A terminated state; the log's tail as its message on failure (what the kubelet does
    with terminationMessagePolicy FallbackToLogsOnError)."""
    state: Obj = {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "finishedAt": _now(),
    }
    if code != 0:
        with contextlib.suppress(OSError):
            state["message"] = (home / "log").read_bytes()[-800:].decode(errors="replace")
    return {"terminated": state}


def _waiting(container: Obj, reason: str) -> Obj:
    return {
        "name": container["name"],
        "image": container["image"],
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "state": {"waiting": {"reason": reason}},
    }


def _expand(text: str, env: Mapping[str, str]) -> str:
    return _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)


async def _exit_code(process: asyncio.subprocess.Process) -> int:
    code = await process.wait()
    return 128 - code if code < 0 else code


async def _first_child(process: asyncio.subprocess.Process) -> int | None:
    """The host pid of the container's PID 1 (the child ``unshare --fork`` made)."""
    path = f"/proc/{process.pid}/task/{process.pid}/children"
    for _ in range(200):
        try:
            with open(path) as file:
                children = file.read().split()
        except OSError:
            return None
        if children:
            return int(children[0])
        await asyncio.sleep(0.005)
    return None
