"""Reaping orphans: the duty of PID 1 in a pid namespace.

Processes whose parent dies are reparented to the namespace's first process. If it never
waits for them they stay zombies and fill the pid table. The reaper peeks at exited children
with ``waitid(P_ALL, WNOWAIT)``, which leaves them waitable, and reaps only those the agent
does not track, so the exit status of a running command is never stolen from it. A tracked
zombie hides any behind it from the peek; its owner reaps it at once and calls :meth:`sweep`
again. Sweeps run on SIGCHLD and, as a safety net, on a timer.

When the agent is not PID 1 but is asked to reap (a sandbox whose first process is something
else, or a test), it makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), so orphans
of its commands are reparented to it rather than to the namespace's init.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
from collections.abc import Callable

__all__ = ["OrphanReaper"]

log = logging.getLogger(__name__)

_SWEEP_INTERVAL_S = 1.0
_PR_SET_CHILD_SUBREAPER = 36


class OrphanReaper:
    """Reaps exited children for which ``is_tracked(pid)`` is false."""

    def __init__(self, is_tracked: Callable[[int], bool]) -> None:
        self._is_tracked = is_tracked
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.reaped = 0
        """How many orphans have been reaped (for tests and logs)."""

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sweep on every SIGCHLD and every second, on ``loop``."""
        self._loop = loop
        subreaper = os.getpid() != 1
        if subreaper:
            _become_subreaper()
        loop.add_signal_handler(signal.SIGCHLD, self.sweep)
        self._schedule()
        log.info("reaping orphaned processes", extra={"pid": os.getpid(), "subreaper": subreaper})

    def stop(self) -> None:
        """Stop sweeping."""
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGCHLD)
            self._loop = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self) -> None:
        if self._loop is not None:
            self._timer = self._loop.call_later(_SWEEP_INTERVAL_S, self._on_timer)

    def _on_timer(self) -> None:
        self.sweep()
        self._schedule()

    def sweep(self) -> None:
        """Reap every exited child that nobody tracks, up to the first tracked one."""
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return  # no children at all
            if info is None or self._is_tracked(info.si_pid):
                return
            try:
                os.waitpid(info.si_pid, os.WNOHANG)
            except ChildProcessError:
                continue
            self.reaped += 1


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(error)}")
