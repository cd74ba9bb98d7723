"""Running commands: spawn in a new session, read both pipes, watch the exit, kill the group.

Everything is driven by event-loop callbacks, not by the coroutine that waits for the result,
so a cancelled call still ends with the process group killed and the child reaped:

- the child is spawned in a new session (``setsid``) with pipes the supervisor owns: by
  ``os.posix_spawn`` when it runs in the agent's own working directory (a third of the cost of
  ``Popen``; every other descriptor of the agent is close-on-exec, inherited ones made so at
  start), else by ``subprocess.Popen`` (``vfork``/``exec``, ``chdir``, other fds closed);
- its exit is watched through a pidfd (``os.pidfd_open``) and reaped with ``waitpid`` on that
  pid only; a thread per child waits where pidfds are missing;
- stdout and stderr are read concurrently with non-blocking reads into one reused buffer;
  bytes past the cap are counted and dropped without being copied;
- the pipes and pidfds of every command sit in one epoll set of the supervisor's, which is
  itself one reader of the event loop: registering a descriptor is one ``epoll_ctl`` rather
  than asyncio's per-reader bookkeeping, and one wakeup serves every ready descriptor, pipes
  before exits, so a command that ended with its pipes closed finishes in that same pass;
- a timeout or :meth:`RunningCommand.kill` sends SIGKILL to the whole process group.

A command is done when its leader has exited and both pipes are closed, or, if something it
left behind in the background still holds a pipe, a short grace after the leader's exit.
Process groups that outlive their leader are remembered and killed at :meth:`close`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import errno
import fcntl
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchard.core.errors import OrchardError, Reason, from_os_error
from orchard.inagent.commands import CommandSpec
from orchard.inagent.reaper import OrphanReaper
from orchard.inagent.reasons import AgentReason

__all__ = [
    "OutputCap",
    "OutputQueue",
    "ProcessLimitReached",
    "ProcessResult",
    "ProcessSupervisor",
    "RunningCommand",
    "Stream",
]

log = logging.getLogger(__name__)

SPAWN_PATIENCE_S = 2.0
"""How long a command waits for room when the sandbox is at its process limit."""
_READ_BYTES = 64 * 1024  # the default pipe capacity: one read empties a full pipe
_READS_PER_WAKEUP = 8
_QUEUE_MERGE_BYTES = 1024 * 1024
# What Popen's restore_signals resets: Python ignores these, and exec keeps an ignored signal.
_DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)


class Stream(enum.IntEnum):
    """Which output a chunk came from."""

    STDOUT = 1
    STDERR = 2


class OutputCap:
    """Counts every byte of one output stream and lets through only the first ``limit``."""

    __slots__ = ("kept", "limit", "total")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = 0
        self.total = 0

    def accept(self, chunk: memoryview) -> memoryview:
        """Count ``chunk`` and return the part of it that still fits under the cap."""
        self.total += len(chunk)
        room = self.limit - self.kept
        if room <= 0:
            return chunk[:0]
        part = chunk[:room]
        self.kept += len(part)
        return part

    @property
    def truncated(self) -> bool:
        """True once bytes have been dropped."""
        return self.total > self.kept


@dataclass(frozen=True)
class ProcessResult:
    """How a command ended, and what it wrote."""

    exit_code: int | None
    """Exit code when the command exited by itself, else None."""
    signal: int | None
    """Signal that ended the command, else None."""
    timed_out: bool
    """True when the timeout passed and the process group was killed."""
    duration_s: float
    """Seconds from spawn to the leader's exit."""
    stdout: bytes
    """Captured stdout (empty when the output was streamed)."""
    stderr: bytes
    """Captured stderr (empty when the output was streamed)."""
    stdout_bytes: int
    stderr_bytes: int
    stdout_truncated: bool
    stderr_truncated: bool


class OutputQueue:
    """Output chunks in the order read, for a streamed command, then the result.

    Adjacent chunks of the same stream are merged while the reader lags, so a slow client gets
    fewer, larger messages rather than a backlog of small ones. The backlog is bounded by the
    output caps (bytes past a cap are never queued).
    """

    def __init__(self) -> None:
        self._chunks: collections.deque[tuple[Stream, bytearray]] = collections.deque()
        self._ready = asyncio.Event()
        self.result: ProcessResult | None = None

    def push(self, stream: Stream, data: memoryview) -> None:
        """Add a chunk (called by the reading side)."""
        if self._chunks:
            last_stream, last = self._chunks[-1]
            if last_stream == stream and len(last) + len(data) <= _QUEUE_MERGE_BYTES:
                last += data
                return
        self._chunks.append((stream, bytearray(data)))
        self._ready.set()

    def finish(self, result: ProcessResult) -> None:
        """Record the result; :meth:`get` returns it after the last chunk."""
        self.result = result
        self._ready.set()

    async def get(self) -> tuple[Stream, bytes] | ProcessResult:
        """The next chunk, or the result once every chunk has been taken."""
        while True:
            if self._chunks:
                stream, data = self._chunks.popleft()
                return stream, bytes(data)
            if self.result is not None:
                return self.result
            self._ready.clear()
            await self._ready.wait()


class _Pipe:
    """The read end of one output pipe and its cap."""

    __slots__ = ("cap", "captured", "fd", "stream")

    def __init__(self, fd: int, stream: Stream, limit: int) -> None:
        self.fd = fd
        self.stream = stream
        self.cap = OutputCap(limit)
        self.captured = bytearray()


class RunningCommand:
    """One spawned command. Created by :meth:`ProcessSupervisor.spawn`."""

    def __init__(
        self,
        supervisor: ProcessSupervisor,
        pid: int,
        popen: subprocess.Popen[bytes] | None,
        *,
        stdout: _Pipe,
        stderr: _Pipe,
        stdin_fd: int,
        spec: CommandSpec,
        queue: OutputQueue | None,
        started_at: float,
    ) -> None:
        self.pid = pid
        self.spec = spec
        self._supervisor = supervisor
        self._loop = supervisor.loop
        self._popen = popen  # kept until reaped, so Popen's own cleanup never waits on the pid
        self.spawned_by = "popen" if popen is not None else "posix_spawn"
        """How the command was started (``posix_spawn`` or ``popen``), for tests and logs."""
        self._outputs = (stdout, stderr)
        self._pipes = [stdout, stderr]
        self._queue = queue
        self._started_at = started_at
        self._result: ProcessResult | None = None
        self._waiters: list[asyncio.Future[ProcessResult]] = []
        self._wait_status: int | None = None
        self._ended_at = 0.0
        self._pidfd = -1
        self._timed_out = False
        self._killed = False
        self._grace_timer: asyncio.TimerHandle | None = None
        self._stdin_fd = stdin_fd
        self._stdin_view = memoryview(spec.stdin)
        self._timer = self._loop.call_later(spec.timeout_s, self._on_timeout)
        for pipe in self._pipes:
            supervisor._watch(pipe.fd, self._on_readable, pipe)
        if stdin_fd >= 0:
            self._write_stdin()
            if self._stdin_fd >= 0:
                self._loop.add_writer(self._stdin_fd, self._write_stdin)
        self._watch_exit()

    # --- what callers use

    async def wait(self) -> ProcessResult:
        """The result once the command is done; cancelling the wait kills the process group."""
        if self._result is not None:
            return self._result
        # A future of the caller's own, resolved directly by _finish: unlike asyncio.shield
        # around a shared one, it costs no extra event-loop pass before the caller resumes.
        waiter: asyncio.Future[ProcessResult] = self._loop.create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            self.kill()
            raise

    @property
    def done(self) -> bool:
        """True once the result is known."""
        return self._result is not None

    def kill(self) -> None:
        """Send SIGKILL to the command's whole process group, once; a no-op when done."""
        if self._killed or self._result is not None:
            return
        self._killed = True
        _kill_group(self.pid)

    # --- exit

    def _watch_exit(self) -> None:
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
                raise
            threading.Thread(
                target=self._wait_in_thread, name=f"wait-{self.pid}", daemon=True
            ).start()
            return
        self._supervisor._watch(self._pidfd, self._on_pidfd_readable, None, exit_event=True)

    def _wait_in_thread(self) -> None:
        _, status = os.waitpid(self.pid, 0)
        self._loop.call_soon_threadsafe(self._on_exit, status)

    def _on_pidfd_readable(self, _: None = None) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere (should not happen): status unknown
            pid, status = self.pid, 0
        if pid == 0:
            return
        self._supervisor._unwatch(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        self._on_exit(status)

    def _on_exit(self, status: int) -> None:
        self._ended_at = time.monotonic()
        self._wait_status = status
        if self._popen is not None:
            self._popen.returncode = os.waitstatus_to_exitcode(status)
        self._supervisor._untrack(self)
        for pipe in list(self._pipes):
            # Usually at end-of-file already (the kernel closes a process's files before it
            # reports the exit): take it now rather than in another pass of the loop.
            self._on_readable(pipe)
        if self._pipes:
            # Something left in the background may hold a pipe open; do not wait on it long.
            self._grace_timer = self._loop.call_later(
                self._supervisor.drain_grace_s, self._stop_reading
            )
        else:
            self._finish()

    def _on_timeout(self) -> None:
        self._timed_out = True
        self.kill()

    # --- pipes

    def _on_readable(self, pipe: _Pipe) -> None:
        buffer = self._supervisor.read_buffer
        for _ in range(_READS_PER_WAKEUP):
            try:
                count = os.readv(pipe.fd, [buffer])
            except BlockingIOError:
                return
            except OSError:
                count = 0
            if count == 0:
                self._close_pipe(pipe)
                return
            kept = pipe.cap.accept(buffer[:count])
            if kept:
                if self._queue is not None:
                    self._queue.push(pipe.stream, kept)
                else:
                    pipe.captured += kept
            if count < len(buffer):
                return  # the pipe is empty for now

    def _close_pipe(self, pipe: _Pipe) -> None:
        self._supervisor._unwatch(pipe.fd)
        os.close(pipe.fd)
        self._pipes.remove(pipe)
        if self._pipes:
            return
        if self._wait_status is not None:
            self._finish()
        elif self._pidfd >= 0:
            # Both pipes closed: most often the command has exited too, so look now rather
            # than in another pass of the loop (a no-op while it still runs).
            self._on_pidfd_readable()

    def _stop_reading(self) -> None:
        for pipe in list(self._pipes):
            self._close_pipe(pipe)

    def _write_stdin(self) -> None:
        try:
            while self._stdin_view:
                written = os.write(self._stdin_fd, self._stdin_view)
                self._stdin_view = self._stdin_view[written:]
        except BlockingIOError:
            return
        except OSError:  # EPIPE: the command closed stdin without reading it all
            pass
        self._close_stdin()

    def _close_stdin(self) -> None:
        if self._stdin_fd >= 0:
            self._loop.remove_writer(self._stdin_fd)
            os.close(self._stdin_fd)
            self._stdin_fd = -1
            self._stdin_view = memoryview(b"")

    # --- end

    def _finish(self) -> None:
        if self._result is not None:
            return
        self._timer.cancel()
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        self._close_stdin()
        status = self._wait_status or 0
        stdout, stderr = self._outputs
        result = ProcessResult(
            exit_code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            timed_out=self._timed_out,
            duration_s=self._ended_at - self._started_at,
            stdout=bytes(stdout.captured),
            stderr=bytes(stderr.captured),
            stdout_bytes=stdout.cap.total,
            stderr_bytes=stderr.cap.total,
            stdout_truncated=stdout.cap.truncated,
            stderr_truncated=stderr.cap.truncated,
        )
        if not self._killed:
            self._supervisor._remember_group(self.pid)
        if self._queue is not None:
            self._queue.finish(result)
        self._result = result
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(result)
        self._waiters.clear()


_Watch = tuple[bool, Callable[[Any], None], Any]


class ProcessSupervisor:
    """Spawns commands, tracks them until reaped, and kills what is left at :meth:`close`.

    With ``reap_orphans`` (the agent is PID 1 of a pid namespace), processes reparented to the
    agent are reaped too, without touching the exit status of commands it tracks.
    """

    def __init__(
        self, *, reap_orphans: bool, drain_grace_s: float = 0.2, use_posix_spawn: bool = True
    ) -> None:
        self.reap_orphans = reap_orphans
        self.drain_grace_s = drain_grace_s
        self.use_posix_spawn = use_posix_spawn and hasattr(os, "posix_spawn")
        """Spawn with ``os.posix_spawn`` where it fits; turned off at start when the agent's
        descriptors cannot all be made close-on-exec."""
        self.read_buffer = memoryview(bytearray(_READ_BYTES))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._devnull = -1
        self._epoll: select.epoll | None = None
        # fd → (is an exit event, callback, its argument), for every descriptor in the epoll set
        self._watched: dict[int, _Watch] = {}
        self._closed = False
        self._running: dict[int, RunningCommand] = {}
        self._lingering_groups: set[int] = set()
        self._reaper: OrphanReaper | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the supervisor was started on."""
        if self._loop is None:
            raise RuntimeError("ProcessSupervisor.start() was not called")
        return self._loop

    def start(self) -> None:
        """Bind to the running event loop; install the orphan reaper when asked to."""
        self._loop = asyncio.get_running_loop()
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._epoll = select.epoll()  # close-on-exec, as Python creates it
        self._loop.add_reader(self._epoll.fileno(), self._on_events)
        if self.use_posix_spawn:
            self.use_posix_spawn = _inherited_fds_made_close_on_exec()
        if self.reap_orphans:
            self._reaper = OrphanReaper(lambda pid: pid in self._running)
            self._reaper.start(self._loop)

    @property
    def running(self) -> int:
        """Commands whose leader has not been reaped yet."""
        return len(self._running)

    async def spawn_when_possible(
        self,
        spec: CommandSpec,
        queue: OutputQueue | None = None,
        *,
        patience_s: float = SPAWN_PATIENCE_S,
    ) -> RunningCommand:
        """`spawn`, waiting up to ``patience_s`` while the sandbox is at its process limit.

        A command killed for its timeout (a fork bomb, say) leaves processes that are still
        exiting and being reaped for a moment, and they count against the limit; a command
        started right then would fail with EAGAIN although the sandbox is about to have room.
        Past ``patience_s`` the error stands (RESOURCE_EXHAUSTED, with what to do).
        """
        deadline = time.monotonic() + patience_s
        delay = 0.005
        while True:
            try:
                return self.spawn(spec, queue)
            except ProcessLimitReached:
                if time.monotonic() + delay > deadline:
                    raise
            if self._reaper is not None:
                self._reaper.sweep()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    def spawn(self, spec: CommandSpec, queue: OutputQueue | None = None) -> RunningCommand:
        """Start ``spec`` in a new session; output goes to ``queue`` or into the result."""
        out_read, out_write = os.pipe2(os.O_CLOEXEC)
        err_read, err_write = os.pipe2(os.O_CLOEXEC)
        stdin_read, stdin_write = os.pipe2(os.O_CLOEXEC) if spec.stdin else (self._devnull, -1)
        started_at = time.monotonic()
        popen: subprocess.Popen[bytes] | None = None
        try:
            if self._fits_posix_spawn(spec, min(stdin_read, out_write, err_write)):
                pid = _posix_spawn(spec, stdin_read, out_write, err_write)
            else:
                popen = subprocess.Popen(
                    spec.argv,
                    executable=spec.executable,
                    stdin=stdin_read,
                    stdout=out_write,
                    stderr=err_write,
                    cwd=spec.cwd,
                    env=spec.env,
                    start_new_session=True,
                    close_fds=True,
                )
                pid = popen.pid
        except BaseException as exc:
            for fd in (out_read, err_read, stdin_write):
                if fd >= 0:
                    os.close(fd)
            if isinstance(exc, OSError):
                raise _spawn_error(exc, spec) from None
            raise
        finally:
            os.close(out_write)
            os.close(err_write)
            if stdin_write >= 0:
                os.close(stdin_read)
        for fd in (out_read, err_read, stdin_write):
            if fd >= 0:
                # One fcntl, not set_blocking's two: a pipe end has no other status flag set.
                fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK)
        stdout = _Pipe(out_read, Stream.STDOUT, spec.output_limit_bytes)
        stderr = _Pipe(err_read, Stream.STDERR, spec.output_limit_bytes)
        try:
            command = RunningCommand(
                self,
                pid,
                popen,
                stdout=stdout,
                stderr=stderr,
                stdin_fd=stdin_write,
                spec=spec,
                queue=queue,
                started_at=started_at,
            )
        except BaseException:
            _kill_group(pid)
            os.waitpid(pid, 0)
            if popen is not None:
                popen.returncode = -signal.SIGKILL
            raise
        # No loop callback (hence no reaper sweep) can run between the spawn and this line.
        self._running[pid] = command
        return command

    def _fits_posix_spawn(self, spec: CommandSpec, lowest_fd: int) -> bool:
        """Whether posix_spawn can start ``spec`` exactly as Popen would.

        Python 3.11's posix_spawn cannot change directory, and posix_spawnp searches the agent's
        own PATH; the child's descriptors must not already sit on 0-2, where a dup2 could
        overwrite one with another.
        """
        if not self.use_posix_spawn or lowest_fd <= 2:
            return False
        if spec.executable is None:
            path = spec.env.get("PATH")
            if path is None or path != os.environ.get("PATH"):
                return False
        try:
            return spec.cwd == os.getcwd()
        except OSError:  # the agent's own directory was removed
            return False

    def _watch(
        self, fd: int, callback: Callable[[Any], None], arg: Any, *, exit_event: bool = False
    ) -> None:
        """Call ``callback(arg)`` whenever ``fd`` is readable, until :meth:`_unwatch`."""
        if self._epoll is None:
            raise RuntimeError("ProcessSupervisor.start() was not called, or it was closed")
        self._epoll.register(fd, select.EPOLLIN)
        self._watched[fd] = (exit_event, callback, arg)

    def _unwatch(self, fd: int) -> None:
        """Stop watching ``fd``; call before closing it."""
        if self._watched.pop(fd, None) is not None and self._epoll is not None:
            self._epoll.unregister(fd)
            if self._closed and not self._watched:
                self._close_epoll()

    def _close_epoll(self) -> None:
        if self._epoll is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._epoll.fileno())
            self._epoll.close()
            self._epoll = None

    def _on_events(self) -> None:
        """Serve every ready descriptor: output first, then exits (see the module docstring)."""
        if self._epoll is None:
            return
        exits: list[int] = []
        for fd, _ in self._epoll.poll(0):
            watch = self._watched.get(fd)
            if watch is None:
                continue
            if watch[0]:
                exits.append(fd)
            else:
                watch[1](watch[2])
        for fd in exits:
            watch = self._watched.get(fd)
            if watch is not None:
                watch[1](watch[2])

    def _untrack(self, command: RunningCommand) -> None:
        self._running.pop(command.pid, None)
        if self._reaper is not None:
            # A tracked zombie hides later ones from the reaper's peek; look again now.
            self._reaper.sweep()

    def _remember_group(self, pgid: int) -> None:
        """Keep ``pgid`` for :meth:`close` if anything is left in it after its leader exited."""
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        self._lingering_groups.add(pgid)

    def close(self) -> None:
        """Kill every running command's process group and every group left behind."""
        groups = set(self._running) | self._lingering_groups
        for pgid in groups:
            _kill_group(pgid)
        if groups:
            log.info("killed leftover process groups", extra={"groups": len(groups)})
        self._lingering_groups.clear()
        if self._reaper is not None:
            self._reaper.stop()
            self._reaper = None
        if self._devnull >= 0:
            os.close(self._devnull)
            self._devnull = -1
        self._closed = True
        if not self._watched:
            # Otherwise commands killed above still report their end; the last one closes it.
            self._close_epoll()


def _posix_spawn(spec: CommandSpec, stdin: int, stdout: int, stderr: int) -> int:
    """Start ``spec`` in the agent's working directory, in a new session; return its pid."""
    actions = [
        (os.POSIX_SPAWN_DUP2, stdin, 0),
        (os.POSIX_SPAWN_DUP2, stdout, 1),
        (os.POSIX_SPAWN_DUP2, stderr, 2),
    ]
    if spec.executable is None:
        return os.posix_spawnp(
            spec.argv[0],
            spec.argv,
            spec.env,
            file_actions=actions,
            setsid=True,
            setsigdef=_DEFAULT_SIGNALS,
        )
    return os.posix_spawn(
        spec.executable,
        spec.argv,
        spec.env,
        file_actions=actions,
        setsid=True,
        setsigdef=_DEFAULT_SIGNALS,
    )


def _inherited_fds_made_close_on_exec() -> bool:
    """Mark every descriptor above 2 close-on-exec; False when they cannot be listed.

    posix_spawn, unlike Popen(close_fds=True), closes nothing: a child must inherit only its
    pipes. What Python and gRPC open is close-on-exec already; this catches what the agent
    itself inherited.
    """
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for name in names:
        fd = int(name)
        if fd > 2:
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
                os.set_inheritable(fd, False)
    return True


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


class ProcessLimitReached(OrchardError):
    """A spawn failed with EAGAIN: the sandbox's pids limit (or the user's) is reached."""


def _spawn_error(exc: OSError, spec: CommandSpec) -> OrchardError:
    """Explain a failed spawn: exec and chdir errors come back from the child as OSError."""
    program = spec.argv[0]
    if exc.filename is not None and os.fsdecode(exc.filename) == spec.cwd:
        if exc.errno == errno.ENOENT:
            return OrchardError(
                AgentReason.WORKING_DIR_NOT_FOUND,
                f"working directory {spec.cwd!r} does not exist",
                metadata={"path": spec.cwd},
            )
        return from_os_error(exc, f"cannot enter working directory {spec.cwd!r}: {exc.strerror}")
    on_path = spec.executable is None
    search_path = spec.env.get("PATH", os.defpath)
    if on_path and exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return OrchardError(
            AgentReason.EXECUTABLE_NOT_FOUND,
            f"executable {program!r} not found on PATH ({search_path})",
            metadata={"executable": program},
        )
    if on_path and exc.errno == errno.EACCES:
        return OrchardError(
            AgentReason.NOT_EXECUTABLE,
            f"{program!r} found on PATH ({search_path}) but it cannot be executed: permission "
            "denied (no execute permission, or a directory)",
            metadata={"executable": program},
        )
    if exc.errno == errno.ENOENT:
        return OrchardError(
            AgentReason.EXECUTABLE_NOT_FOUND,
            f"cannot execute {program!r}: it, or the interpreter its #! line names, does not exist",
            metadata={"executable": program},
        )
    if exc.errno == errno.EACCES:
        return OrchardError(
            AgentReason.NOT_EXECUTABLE,
            f"cannot execute {program!r}: permission denied",
            metadata={"executable": program},
        )
    if exc.errno == errno.EAGAIN:
        return ProcessLimitReached(
            Reason.RESOURCE_EXHAUSTED,
            f"cannot start {program!r}: the sandbox is at its process limit (fork failed: "
            "resource temporarily unavailable); wait for its processes to end, kill them, or "
            "create the sandbox with a higher resources.pids",
            metadata={"executable": program, "errno": "EAGAIN"},
        )
    if exc.errno == errno.ENOEXEC:
        return OrchardError(
            Reason.FAILED_PRECONDITION,
            f"cannot execute {program!r}: not a valid executable (no #! line, or built for "
            "another architecture)",
            metadata={"executable": program},
        )
    return from_os_error(exc, f"cannot execute {program!r}: {exc.strerror}")
