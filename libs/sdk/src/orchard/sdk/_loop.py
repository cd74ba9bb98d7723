"""A private event loop on a daemon thread: how the sync client runs the async one.

One implementation (the async client) holds retries, error mapping, transfers and heartbeats;
the sync client submits coroutines here and waits. It also works where the calling thread
already runs an event loop (a notebook), where ``asyncio.run`` would refuse.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["LoopThread"]


class LoopThread:
    """Runs coroutines on its own loop; ``close()`` stops the loop and joins the thread."""

    def __init__(self, name: str = "orchard-sdk") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        # Let cancelled tasks (heartbeats) run their finally blocks before the loop closes.
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop and return its result; Ctrl-C cancels it there."""
        if self._closed:
            coroutine.close()
            raise RuntimeError("the client is closed")
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("a sync client call cannot be made from its own loop")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            # KeyboardInterrupt in this thread: cancel the call on the loop and wait for it to
            # unwind, so that cancelling an exec kills the command.
            if not future.done():
                future.cancel()
                with contextlib.suppress(concurrent.futures.CancelledError, Exception):
                    future.result(timeout=5)
            raise

    def iterate(self, iterator: AsyncIterator[T]) -> Iterator[T]:
        """A sync iterator over an async one; closing it early closes the async one."""
        try:
            while True:
                try:
                    item = self.run(_next(iterator))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            close = getattr(iterator, "aclose", None)
            if close is not None and not self._closed:
                self.run(close())

    def close(self) -> None:
        """Stop the loop (tasks still on it are cancelled) and join the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


async def _next(iterator: AsyncIterator[T]) -> T:
    return await anext(iterator)
