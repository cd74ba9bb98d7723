"""``NodeImageIndex``: which nodes already hold which images, from one LIST+WATCH over Nodes.

Each kubelet reports the images its node holds in ``Node.status.images`` (every name of an
image: tags and digests, biggest images first, at most ``--node-status-max-images`` of them,
50 by default). The index keeps, per node, those names in normalized form (``python:3.12`` and
``docker.io/library/python:3.12`` are one image), and answers which nodes hold an image
reference. The runtime turns the answer into a *preferred* node affinity of a sandbox Pod: a
start without a pull where it can, and scheduling as usual where no node has the image (the
default scheduler's ImageLocality score points the same way, with a small weight).

The stream works as the sandbox Pod watch does: a LIST, then a watch from its resourceVersion
with bookmarks, resumed where it ended, a new LIST after 410 Expired. Node status changes are
rare (kubelets heartbeat through Leases, not Node updates).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from kubernetes_asyncio.client import ApiException, CoreV1Api
from kubernetes_asyncio.watch import Watch

from orchard.env.runtime.kubernetes.api import call_api

__all__ = ["NodeImageIndex", "image_keys"]

log = logging.getLogger(__name__)

_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_DEFAULT_DOMAIN = "docker.io"


def image_keys(reference: str) -> set[str]:
    """The normalized names an image reference is known by on a node: ``domain/path:tag``
    and, with a digest, ``domain/path@digest`` (Docker Hub's short names get ``docker.io`` and
    ``library/``, a reference without tag or digest ``:latest``, as container runtimes do)."""
    name, _, digest = reference.strip().partition("@")
    tag = ""
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    first, _, rest = name.partition("/")
    if not rest or ("." not in first and ":" not in first and first != "localhost"):
        domain, path = _DEFAULT_DOMAIN, name
    else:
        domain, path = first, rest
    if domain in ("index.docker.io", "registry-1.docker.io"):
        domain = _DEFAULT_DOMAIN
    if domain == _DEFAULT_DOMAIN and "/" not in path:
        path = f"library/{path}"
    keys = set()
    if digest:
        keys.add(f"{domain}/{path}@{digest}")
    if tag or not digest:
        keys.add(f"{domain}/{path}:{tag or 'latest'}")
    return keys


def _node_keys(node: Mapping[str, Any]) -> tuple[str, frozenset[str]]:
    name = str((node.get("metadata") or {}).get("name", ""))
    keys: set[str] = set()
    for image in (node.get("status") or {}).get("images") or ():
        for image_name in image.get("names") or ():
            keys |= image_keys(str(image_name))
    return name, frozenset(keys)


class _Expired(Exception):
    """The watch's resourceVersion is older than the server keeps (410)."""


class NodeImageIndex:
    """The images each node holds (see the module docstring)."""

    def __init__(self, core: CoreV1Api, *, watch_timeout_s: int, request_timeout_s: float) -> None:
        self.core = core
        self.watch_timeout_s = watch_timeout_s
        self.request_timeout_s = request_timeout_s
        self.resource_version = ""
        self.lists = 0
        self._nodes: dict[str, frozenset[str]] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """LIST once (errors raise here: no permission on nodes), then watch."""
        await self._list()
        self._task = asyncio.create_task(self._run(), name="node-image-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- reading -----------------------------------------------------------------------------

    def nodes(self) -> list[str]:
        """Every node seen."""
        return sorted(self._nodes)

    def nodes_with(self, reference: str) -> list[str]:
        """The nodes that hold the image ``reference``, by name."""
        wanted = image_keys(reference)
        return sorted(name for name, keys in self._nodes.items() if keys & wanted)

    def holds(self, node: str, reference: str) -> bool:
        return bool(self._nodes.get(node, frozenset()) & image_keys(reference))

    async def changed(self) -> None:
        """Return after the next change of any node's images (or its arrival, or departure)."""
        await self._changed.wait()

    # -- the stream --------------------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        relist = False
        while True:
            try:
                if relist:
                    await self._list()
                    relist = False
                await self._watch()
                failures = 0
            except asyncio.CancelledError:
                raise
            except _Expired:
                relist = True
            except Exception as exc:
                delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
                failures += 1
                log.warning("node image watch broke (%r); resuming in %.1f s", exc, delay)
                await asyncio.sleep(delay)

    async def _list(self) -> None:
        data = await call_api(
            self.core.list_node(_preload_content=False, _request_timeout=self.request_timeout_s)
        )
        self.lists += 1
        self._replace(_node_keys(item) for item in data.get("items") or ())
        self.resource_version = str((data.get("metadata") or {}).get("resourceVersion", ""))

    async def _watch(self) -> None:
        async with Watch(return_type="object") as watch:
            stream = watch.stream(
                self.core.list_node,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.watch_timeout_s,
                _request_timeout=self.watch_timeout_s + self.request_timeout_s,
            )
            try:
                async for event in stream:
                    self._apply(str(event["type"]), event["raw_object"])
            except ApiException as exc:
                if exc.status == 410:
                    raise _Expired from None
                raise

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        version = str((obj.get("metadata") or {}).get("resourceVersion", ""))
        if version:
            self.resource_version = version
        if kind == "BOOKMARK":
            return
        name, keys = _node_keys(obj)
        if kind == "DELETED":
            changed = self._nodes.pop(name, None) is not None
        else:
            changed = self._nodes.get(name) != keys
            self._nodes[name] = keys
        if changed:
            self._notify()

    def _replace(self, nodes: Iterable[tuple[str, frozenset[str]]]) -> None:
        fresh = dict(nodes)
        if fresh != self._nodes:
            self._nodes = fresh
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
