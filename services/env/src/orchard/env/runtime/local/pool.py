"""Pooled sandboxes ("shells"): what a create can do before it knows its request, done ahead.

Measured on a 2-core host (zygote launch, host image, idle machine): a fresh create spends
about 18 ms forking the zygote's helper and PID 1 and entering the namespaces, about 15 ms
building the root (overlay, ``/dev``, ``/proc``, ``/sys``, masks, ``pivot_root``) and starting
the agent, and under 1 ms on its cgroup and state file; a network namespace costs about 0.5 ms
and a sandbox without egress rules has no link. So a shell is a sandbox's PID 1 already in its
own namespaces, in a cgroup, inside its root, with the image's overlay mounted, waiting for a
claim (see :mod:`~orchard.env.runtime.local.sandbox_init`). Links and addresses are not pooled:
only sandboxes with egress rules have one, and the runtime adds it while the agent starts.

A shell is an ordinary sandbox of the runtime under an id no request can use (``_shell-`` and
12 hex digits): a state file first, its workspace and run directories, its cgroup. Claiming one
moves its PID 1 into a new cgroup named after the sandbox (with the request's limits), renames
its directories to the sandbox's, and writes the claim; the agent then starts as in a fresh
sandbox. Memory the shell touched before the claim stays charged to the runtime's cgroup
parent, not to the sandbox (a few MB at most).

Shells match one image (its layers and masks): the pool builds for the image of the latest
create, at most ``pool_size`` at a time, one at a time in the background, and refills after
each claim. A shell's PID 1 holds the read end of its claim FIFO, whose only writer is this
runtime: when the runtime exits, crashed or not, every shell ends by itself; what remains
(directories, state file, cgroup) is listed by ``list_sandboxes`` as a leftover, which the
service's reconcile deletes, and the next start of the runtime removes as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import select
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from orchard.env.runtime.local.spawn import StartedSandbox
from orchard.env.runtime.local.state import SandboxState

__all__ = ["SHELL_ID", "PoolKey", "Shell", "ShellPool", "new_shell_id"]

log = logging.getLogger(__name__)

SHELL_ID = re.compile(r"_shell-[0-9a-f]{12}")
"""Ids of pooled sandboxes: outside what a request may name (ids start with a letter or digit)."""
_RETRY_AFTER_FAILURE_S = 5.0
_CLOSE_WAIT_S = 10.0


def new_shell_id() -> str:
    return f"_shell-{secrets.token_hex(6)}"


@dataclass(frozen=True)
class PoolKey:
    """What a shell fixed of its sandbox when it was built: the layers and masks of its root."""

    lower_dirs: tuple[str, ...]
    masked_dirs: tuple[str, ...]


@dataclass
class Shell:
    """A pooled sandbox waiting for its claim."""

    key: PoolKey
    state: SandboxState
    started: StartedSandbox  # its PID 1, pidfd and ready pipe (past the ``#shell`` line)
    claim_fd: int  # this runtime's end of the claim FIFO (the only writer)

    @property
    def shell_id(self) -> str:
        return self.state.sandbox_id

    def alive(self) -> bool:
        """Whether its PID 1 still waits (a pidfd turns readable when the process exits)."""
        poller = select.poll()
        poller.register(self.started.pidfd, select.POLLIN)
        return not poller.poll(0)

    def close_fds(self) -> None:
        for fd in (self.claim_fd, self.started.pidfd, self.started.ready_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


BuildShell = Callable[[PoolKey], Coroutine[Any, Any, Shell]]
DiscardShell = Callable[[Shell], Coroutine[Any, Any, None]]


class ShellPool:
    """Up to ``size`` shells for the image of the latest create; refilled in the background."""

    def __init__(self, size: int, build: BuildShell, discard: DiscardShell) -> None:
        self.size = size
        self._build = build
        self._discard = discard
        self._key: PoolKey | None = None
        self._ready: list[Shell] = []
        self._building: set[str] = set()  # filled in by the build callback, via ``building``
        self._filler: asyncio.Task[None] | None = None
        self._discards: set[asyncio.Task[None]] = set()
        self._discarding: set[str] = set()
        self._failed_at = -_RETRY_AFTER_FAILURE_S
        self._closed = False
        self._pinned = False  # the key is the operator's (pool_image): creates do not move it

    @property
    def enabled(self) -> bool:
        return self.size > 0 and not self._closed

    def building(self, shell_id: str) -> None:
        """Called by the build callback before it makes anything of ``shell_id``."""
        self._building.add(shell_id)

    def owns(self, shell_id: str) -> bool:
        """Whether the shell is this pool's (waiting, or being built)."""
        return (
            shell_id in self._building
            or shell_id in self._discarding
            or any(s.shell_id == shell_id for s in self._ready)
        )

    def __len__(self) -> int:
        return len(self._ready)

    def take(self, key: PoolKey, *, pinned_image: bool = False) -> Shell | None:
        """A live shell built for ``key``, or None; either way the pool now fills for ``key``
        (from the next :meth:`refill`), unless it is pinned to an image and this create is
        not of that image (``pinned_image``: it is; the same reference may resolve to other
        masks for a tenant than for the operator)."""
        if not self.enabled:
            return None
        if key != self._key:
            if self._pinned and not pinned_image:
                return None
            self._key = key
            stale, self._ready = self._ready, []
            for shell in stale:
                self._drop(shell)
        found = None
        while self._ready:
            shell = self._ready.pop()
            if shell.alive():
                found = shell
                break
            log.warning("pooled sandbox %s exited while waiting", shell.shell_id)
            self._drop(shell)
        return found

    async def pin(self, key: PoolKey) -> None:
        """Build for ``key`` only, from now on; return once one shell is ready (or failed)."""
        if not self.enabled:
            return
        self._key, self._pinned = key, True
        self._filler = asyncio.create_task(self._fill(limit=1), name="orchard-env-shell-pool")
        await asyncio.shield(self._filler)
        self.refill()

    def refill(self) -> None:
        """Build shells in the background up to the size (the runtime calls this once a create
        is done, so that building never competes with the agent a create waits for)."""
        if not self.enabled or self._key is None or len(self._ready) >= self.size:
            return
        if self._filler is not None and not self._filler.done():
            return
        loop = asyncio.get_running_loop()
        if loop.time() - self._failed_at < _RETRY_AFTER_FAILURE_S:
            return
        self._filler = asyncio.create_task(self._fill(), name="orchard-env-shell-pool")

    async def _fill(self, limit: int | None = None) -> None:
        goal = self.size if limit is None else min(limit, self.size)
        while self.enabled and self._key is not None and len(self._ready) < goal:
            key = self._key
            try:
                shell = await self._build(key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed_at = asyncio.get_running_loop().time()
                log.warning("cannot build a pooled sandbox (retried after a while): %s", exc)
                return
            finally:
                self._building.clear()
            if self.enabled and key == self._key and len(self._ready) < self.size:
                self._ready.append(shell)
            else:
                self._drop(shell)

    def _drop(self, shell: Shell) -> None:
        self._discarding.add(shell.shell_id)
        task = asyncio.create_task(self._discard(shell))
        self._discards.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self._discards.discard(task)
            self._discarding.discard(shell.shell_id)

        task.add_done_callback(done)

    async def close(self) -> None:
        """Stop filling and release every shell (each ends and is removed)."""
        self._closed = True
        if self._filler is not None:
            # The build under way finishes (a spawn cut short would leave its helper behind),
            # then its shell is released like the others.
            try:
                await asyncio.wait_for(asyncio.shield(self._filler), _CLOSE_WAIT_S)
            except TimeoutError:
                self._filler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._filler
        stale, self._ready = self._ready, []
        for shell in stale:
            self._drop(shell)
        while self._discards:
            await asyncio.gather(*self._discards, return_exceptions=True)
