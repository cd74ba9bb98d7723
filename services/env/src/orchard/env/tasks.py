"""Background tasks a part of the service starts and ends with itself."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

__all__ = ["BackgroundTasks"]

log = logging.getLogger(__name__)


class BackgroundTasks:
    """Short tasks (``spawn``) and long-running loops (``start``), all cancelled by ``close``;
    one that ends in an exception is logged, never lost."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[Any]] = []
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any] | None:
        """Run ``coro`` in the background; after :meth:`close` it is dropped (None)."""
        if self._closed:
            coro.close()
            return None
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(log_failure)
        return task

    def start(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._loops.append(task)
        task.add_done_callback(log_failure)
        return task

    async def close(self) -> None:
        self._closed = True
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def log_failure(task: asyncio.Task[Any]) -> None:
    """A background task must not end in an exception nobody sees."""
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed", task.get_name(), exc_info=task.exception())
