"""Files a task brings: archives in the artifact store, unpacked into each rollout's sandbox
before its setup runs.

A task names them in its settings (``"files": [{"url": "file:///…/repo.tar.gz", "path":
"/testbed"}]``); the rollout service reads each archive through its artifact store (the URL must
lie under the store's root or an allowed prefix), writes it into the fresh sandbox and unpacks it
there with ``tar``. So a task's repository travels by URL, never as a path on the client's
machine. Archives are immutable artifacts: each is read once per process and kept in a bounded
cache, since every rollout of a task needs the same bytes.
"""

from __future__ import annotations

import asyncio
import shlex
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from orchard.core.artifacts import ArtifactStore
    from orchard.rollout.tasks import TaskFile
    from orchard.sdk import AsyncSandbox

__all__ = ["FileSource", "StoreFiles", "TaskFilesError", "place_files"]

STAGING_DIR = "/tmp/.orchard-task-files"
"""Where an archive lands in the sandbox before it is unpacked (removed afterwards)."""


class TaskFilesError(Exception):
    """A task's files could not be placed in its sandbox; the message says which and why."""


class FileSource(Protocol):
    """Where a runner gets a task archive's bytes."""

    def check(self, url: str) -> str:
        """The URL, checked (raises the artifact layer's errors for a bad or forbidden one)."""
        ...

    async def read(self, url: str) -> bytes:
        """The archive's bytes."""
        ...


class StoreFiles:
    """Task archives from an `ArtifactStore`, cached by URL up to ``cache_bytes`` in total."""

    def __init__(self, store: ArtifactStore, *, cache_bytes: int = 64 * 1024 * 1024) -> None:
        self.store = store
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}

    def check(self, url: str) -> str:
        return self.store.check(url, what="task files URL").url

    async def read(self, url: str) -> bytes:
        lock = self._locks.setdefault(url, asyncio.Lock())
        async with lock:
            if url in self._cache:
                self._cache.move_to_end(url)
                return self._cache[url]
            data = await asyncio.to_thread(self.store.read_bytes, url)
            if len(data) <= self.cache_bytes:
                self._cache[url] = data
                while sum(map(len, self._cache.values())) > self.cache_bytes:
                    self._cache.popitem(last=False)
            return data


async def place_files(
    sandbox: AsyncSandbox, files: tuple[TaskFile, ...], source: FileSource
) -> None:
    """Unpack each archive of ``files`` at its path in ``sandbox``; raises `TaskFilesError`."""
    for index, item in enumerate(files):
        try:
            data = await source.read(item.url)
        except Exception as exc:  # the artifact layer's errors carry the URL and the cause
            raise TaskFilesError(f"task files {item.url}: {exc}") from exc
        staged = f"{STAGING_DIR}/{index}.tar"
        await sandbox.write_file(staged, data, mode=0o600)
        path = shlex.quote(item.path)
        result = await sandbox.exec(
            [
                "/bin/sh",
                "-c",
                f"mkdir -p {path} && tar -xf {staged} -C {path}; status=$?; rm -f {staged}; "
                "exit $status",
            ],
            timeout=300,
        )
        if not result.ok:
            raise TaskFilesError(
                f"unpacking {item.url} at {item.path} exited {result.exit_code}: "
                f"{result.stderr_text[-500:]}"
            )
