"""``SandboxPodWatch``: one LIST+WATCH stream over every sandbox Pod, and a cache of them.

A LIST gives the Pods and a resourceVersion; a watch from that version gives every change
after it, with bookmarks on (the server then sends the version it has reached even while no
sandbox Pod changes, so a resume after a quiet hour does not start from an expired version). A
watch that ends (its server-side timeout, a dropped connection) resumes from the last version
seen, without a LIST. A version the server no longer keeps (410 Expired) means events may be
lost: LIST again, and report what changed in between as changes.

Waiters (``wait_for``) sleep on an event per Pod name that the stream sets; nobody polls the
API server per sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio.client import ApiException, CoreV1Api
from kubernetes_asyncio.watch import Watch

from orchard.env.runtime.kubernetes.api import call_api
from orchard.env.runtime.kubernetes.pods import PodView

__all__ = ["PodChange", "SandboxPodWatch"]

log = logging.getLogger(__name__)

PodChange = Callable[[str, PodView | None, PodView | None], None]
"""Called with (name, before, after) for every change of a cached Pod; None: absent."""

_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _Expired(Exception):
    """The watch's resourceVersion is older than the server keeps (410)."""


class SandboxPodWatch:
    """The cache of sandbox Pods (see the module docstring)."""

    def __init__(
        self,
        core: CoreV1Api,
        namespace: str,
        selector: str,
        *,
        on_change: PodChange,
        watch_timeout_s: int,
        request_timeout_s: float,
    ) -> None:
        self.core = core
        self.namespace = namespace
        self.selector = selector
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.request_timeout_s = request_timeout_s
        self.resource_version = ""
        self.lists = 0  # LIST calls so far: 1 + one per expiry
        self.bookmarks = 0
        self._pods: dict[str, PodView] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._first_error: BaseException | None = None

    async def start(self) -> None:
        """LIST once (errors raise here: API unreachable, no permission), then watch."""
        await self._list()
        self._task = asyncio.create_task(self._run(), name="sandbox-pod-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- reading the cache -------------------------------------------------------------------

    def view(self, name: str) -> PodView | None:
        return self._pods.get(name)

    def names(self) -> list[str]:
        return sorted(self._pods)

    async def wait_for(
        self, name: str, done: Callable[[PodView | None], bool], timeout_s: float
    ) -> PodView | None:
        """The Pod's view once ``done(view)`` holds; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            view = self._pods.get(name)
            if done(view):
                return view
            changed = self._changed.setdefault(name, asyncio.Event())
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            await asyncio.wait_for(changed.wait(), left)

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
                log.info(
                    "sandbox pod watch: resourceVersion %s expired; listing again",
                    self.resource_version,
                )
                relist = True
            except Exception as exc:
                delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
                failures += 1
                log.warning("sandbox pod watch broke (%r); resuming in %.1f s", exc, delay)
                await asyncio.sleep(delay)

    async def _list(self) -> None:
        data = await call_api(
            self.core.list_namespaced_pod(
                self.namespace,
                label_selector=self.selector,
                _preload_content=False,
                _request_timeout=self.request_timeout_s,
            )
        )
        self.lists += 1
        fresh = {}
        for item in data.get("items") or ():
            view = PodView.of(item)
            fresh[view.name] = view
        old, self._pods = self._pods, fresh
        self.resource_version = str((data.get("metadata") or {}).get("resourceVersion", ""))
        for name in sorted(set(old) | set(fresh)):
            if old.get(name) != fresh.get(name):
                self._notify(name, old.get(name), fresh.get(name))
        self._synced.set()

    async def _watch(self) -> None:
        async with Watch(return_type="object") as watch:
            stream = watch.stream(
                self.core.list_namespaced_pod,
                self.namespace,
                label_selector=self.selector,
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
        if kind == "BOOKMARK":
            self.bookmarks += 1
            self.resource_version = version or self.resource_version
            return
        view = PodView.of(obj)
        before = self._pods.get(view.name)
        if kind == "DELETED":
            self._pods.pop(view.name, None)
            after = None
        else:
            self._pods[view.name] = view
            after = view
        if version:
            self.resource_version = version
        self._notify(view.name, before, after)

    def _notify(self, name: str, before: PodView | None, after: PodView | None) -> None:
        changed = self._changed.pop(name, None)
        if changed is not None:
            changed.set()
        try:
            self.on_change(name, before, after)
        except Exception:
            log.exception("sandbox pod change handler failed for %s", name)
