"""Starting sandboxes through the agent's fork server ("zygote") instead of an exec per sandbox.

With ``agent_launch: zygote`` the local runtime keeps one ``orchard.inagent.zygote`` process
that has imported the agent and grpc once; each sandbox is a fork of it, so a start costs a fork
and the namespace work instead of an interpreter start and the agent's imports, and the
preloaded pages stay shared between sandboxes. Everything after the fork is the exec path's:
the same setup functions (``sandbox_init.py``), the same flags, the same ready pipe, a
:class:`~orchard.env.runtime.local.spawn.StartedSandbox` with the sandbox's PID 1 and a pidfd.

The zygote talks over one ``SOCK_SEQPACKET`` socket pair (no path, so nothing a sandbox or
another host user could reach); each request carries its own reply socket. Sandboxes never
depend on the zygote: its helper hands over a pidfd and exits, and PID 1 is reparented to the
host's init. If the zygote dies it is started again on the next request; it exits when this
side's end closes, so it never outlives the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import os
import select
import socket
import sys
from collections.abc import Mapping

from orchard.env.runtime.base import FailureReason, RuntimeFailure, RuntimeUnavailable
from orchard.env.runtime.local.process import process_start_time
from orchard.env.runtime.local.spawn import SANDBOX_INIT, AgentLaunch, StartedSandbox

__all__ = ["AgentZygote"]

log = logging.getLogger(__name__)

ZYGOTE_MODULE = "orchard.inagent.zygote"
_READY_MESSAGE = b"ready"  # orchard.inagent.zygote.READY_MESSAGE (not imported: other package)
_START_TIMEOUT_S = 30.0
_REPLY_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0
# What the zygote's interpreter may need to find its modules; nothing else of the service's
# environment, which every sandbox's PID 1 (a fork) would otherwise show in /proc/1/environ.
_ZYGOTE_ENV_KEEP = ("PYTHONPATH", "PYTHONHOME")


def zygote_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The zygote's whole environment: the interpreter's module path settings, if any."""
    return {name: environ[name] for name in _ZYGOTE_ENV_KEEP if name in environ}


class _ZygoteGone(Exception):
    """The zygote died with the request unanswered (nothing was forked for it)."""


async def _wait_fd(fd: int, *, writable: bool, timeout_s: float | None) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def on_ready() -> None:
        if not ready.done():
            ready.set_result(None)

    (loop.add_writer if writable else loop.add_reader)(fd, on_ready)
    try:
        await asyncio.wait_for(ready, timeout_s)
    finally:
        (loop.remove_writer if writable else loop.remove_reader)(fd)


class AgentZygote:
    """The runtime's fork server: started on demand, restarted when it died, closed with it."""

    def __init__(self, python: str = "") -> None:
        self.python = python or sys.executable
        self._process: asyncio.subprocess.Process | None = None
        self._control: socket.socket | None = None
        self._starting: asyncio.Lock | None = None

    @property
    def pid(self) -> int | None:
        """The zygote's pid while one runs (for tests and logs)."""
        return self._process.pid if self._alive() and self._process else None

    def _alive(self) -> bool:
        return self._process is not None and self._process.returncode is None

    async def start(self) -> None:
        """Start the zygote unless one runs; return once it takes requests."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._alive():
                return
            await self._stop()
            await self._start_locked()

    async def _start_locked(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = await asyncio.create_subprocess_exec(
                self.python,
                "-m",
                ZYGOTE_MODULE,
                "--control-fd",
                str(theirs.fileno()),
                "--setup",
                str(SANDBOX_INIT),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # the service's signals are not the sandboxes'
                cwd="/",
                env=zygote_environment(os.environ),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._process, self._control = process, ours
        try:
            await _wait_fd(ours.fileno(), writable=False, timeout_s=_START_TIMEOUT_S)
            hello = ours.recv(64)
        except (TimeoutError, OSError) as exc:
            hello = repr(exc).encode()
        if hello != _READY_MESSAGE:
            await self._stop()
            raise RuntimeUnavailable(
                f"the agent's fork server ({self.python} -m {ZYGOTE_MODULE}) did not start "
                f"({hello.decode(errors='replace') or 'it exited'}); is orchard-inagent "
                "installed in that interpreter? (or use agent_launch: exec)"
            )
        log.info("agent zygote ready", extra={"pid": process.pid})

    async def close(self) -> None:
        """Stop the zygote (sandboxes keep running)."""
        await self._stop()

    async def _stop(self) -> None:
        control, process = self._control, self._process
        self._control = self._process = None
        if control is not None:
            control.close()  # the zygote exits on end-of-file
        if process is not None and process.returncode is None:
            try:
                await asyncio.wait_for(process.wait(), _STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()

    async def start_sandbox_process(self, launch: AgentLaunch) -> StartedSandbox:
        """Like :func:`~orchard.env.runtime.local.spawn.start_sandbox_process`, by a fork."""
        for attempt in range(2):
            await self.start()
            try:
                return await self._spawn(launch)
            except _ZygoteGone:
                log.warning("agent zygote died; starting another", extra={"attempt": attempt})
                await self._stop()
        raise RuntimeFailure(FailureReason.INTERNAL, "the agent's fork server keeps dying")

    async def _spawn(self, launch: AgentLaunch) -> StartedSandbox:
        control = self._control
        if control is None:
            raise _ZygoteGone
        ready_read, ready_write = os.pipe2(os.O_CLOEXEC)
        reply, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            payload = marshal.dumps(launch.plan(-1))  # the zygote fills in its ready_fd
            while True:
                try:
                    socket.send_fds(control, [payload], [ready_write, theirs.fileno()])
                    break
                except BlockingIOError:
                    await _wait_fd(control.fileno(), writable=True, timeout_s=_REPLY_TIMEOUT_S)
                except (BrokenPipeError, ConnectionResetError) as exc:
                    raise _ZygoteGone from exc
        except BaseException:
            os.close(ready_read)
            reply.close()
            raise
        finally:
            os.close(ready_write)
            theirs.close()
        try:
            return await self._receive(reply, ready_read)
        except BaseException:
            os.close(ready_read)
            raise
        finally:
            reply.close()

    async def _receive(self, reply: socket.socket, ready_read: int) -> StartedSandbox:
        reply.setblocking(False)
        try:
            await _wait_fd(reply.fileno(), writable=False, timeout_s=_REPLY_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeFailure(
                FailureReason.INTERNAL, "the agent's fork server did not answer"
            ) from None
        data, fds, _, _ = socket.recv_fds(reply, 64, 1)
        if not data or not fds:
            for fd in fds:
                os.close(fd)
            # Nothing forked, or the helper failed: its reason, if any, is on the ready pipe.
            early = StartedSandbox(0, 0, -1, ready_read)
            try:
                await early.wait_ready(_REPLY_TIMEOUT_S)
            except RuntimeFailure as failure:
                if failure.reason is not FailureReason.AGENT_EXITED:
                    raise
            if not self._alive() or not await self._answers():
                raise _ZygoteGone
            raise RuntimeFailure(FailureReason.INTERNAL, "sandbox setup failed in the fork server")
        pid, pidfd = int(data), fds[0]
        start_time = process_start_time(pid) or 0
        # The pidfd is not readable while PID 1 lives: then the start time read above is its own.
        if not start_time or _readable_now(pidfd):
            os.close(pidfd)
            early = StartedSandbox(pid, start_time, -1, ready_read)
            await early.wait_ready(_REPLY_TIMEOUT_S)
            raise RuntimeFailure(FailureReason.INTERNAL, "the sandbox's first process vanished")
        return StartedSandbox(pid, start_time, pidfd, ready_read)

    async def _answers(self) -> bool:
        """Whether the zygote process still runs (its exit may not be collected yet)."""
        process = self._process
        if process is None:
            return False
        try:
            await asyncio.wait_for(asyncio.shield(process.wait()), 0.05)
        except TimeoutError:
            return True
        return False


def _readable_now(fd: int) -> bool:
    """Whether ``fd`` is readable without waiting; poll, unlike select, takes any fd number."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
