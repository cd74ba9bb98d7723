"""Starting a sandbox's first process from the service, and hearing when its agent serves.

The service never forks itself (it runs gRPC threads): it starts ``sandbox_init.py`` in a new
session with a fresh interpreter (``-S -E``: no site packages, about 10 ms), which does the
namespace work and becomes the agent (see :mod:`orchard.env.runtime.local.sandbox_init`).
Readiness is a pipe: the agent writes its addresses to it and closes it (``--ready-fd``), so
the wait is one read on the event loop, bounded by the start timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import marshal
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchard.env.runtime.base import FailureReason, RuntimeFailure
from orchard.env.runtime.local.process import open_pidfd, process_start_time

__all__ = ["AgentLaunch", "StartedSandbox", "read_to_eof", "start_sandbox_process"]

SANDBOX_INIT = Path(__file__).with_name("sandbox_init.py")
SHELL_READY = b"#shell\n"  # sandbox_init.SHELL_READY (that module is a script: not imported)
_HELPER_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class AgentLaunch:
    """Everything ``sandbox_init.py`` needs (sent as a hex-encoded ``marshal`` dict)."""

    hostname: str
    root: str
    lower_dirs: tuple[str, ...]
    upper_dir: str
    work_dir: str
    agent_bundle: str
    run_dir: str  # the agent's socket goes here; never mounted into the sandbox
    socket_name: str
    lane_name: str  # the agent's exec lane, beside its socket; "" for none
    working_dir: str
    masked_dirs: tuple[str, ...]
    cgroup_procs: tuple[str, ...]
    log_file: str
    argv: tuple[str, ...]  # the agent and its flags, less those sandbox_init adds
    env: dict[str, str]
    raw_sockets: bool = False  # commands keep CAP_NET_RAW
    user_namespaces: bool = False  # commands may create user namespaces
    claim_fifo: str = ""  # set: a pooled sandbox, which waits there for its claim (pool.py)

    def plan(self, ready_fd: int) -> dict[str, Any]:
        plan = {name: getattr(self, name) for name in self.__dataclass_fields__}
        plan["ready_fd"] = ready_fd
        return plan


@dataclass
class StartedSandbox:
    """The sandbox's PID 1 (the agent-to-be) on the host, and the pipe that says it serves."""

    pid: int
    start_time: int
    pidfd: int
    ready_fd: int

    async def wait_ready(self, timeout_s: float) -> list[str]:
        """The agent's addresses once it serves; :class:`RuntimeFailure` otherwise."""
        try:
            text = await asyncio.wait_for(read_to_eof(self.ready_fd), timeout_s)
        except TimeoutError:
            raise RuntimeFailure(
                FailureReason.AGENT_START_TIMEOUT,
                f"the agent did not serve within {timeout_s:g} s",
            ) from None
        lines = text.decode(errors="replace").splitlines()
        _raise_failure(lines)
        if not lines:
            raise RuntimeFailure(FailureReason.AGENT_EXITED, "the agent exited before it served")
        return lines

    async def wait_shell(self, timeout_s: float) -> None:
        """Return once a pooled sandbox waits for its claim (its ``#shell`` line)."""
        try:
            text = await asyncio.wait_for(_read_line(self.ready_fd), timeout_s)
        except TimeoutError:
            raise RuntimeFailure(
                FailureReason.AGENT_START_TIMEOUT,
                f"the pooled sandbox was not built within {timeout_s:g} s",
            ) from None
        if text == SHELL_READY:
            return
        _raise_failure(text.decode(errors="replace").splitlines())
        raise RuntimeFailure(FailureReason.AGENT_EXITED, "the pooled sandbox exited unclaimed")

    def close(self) -> None:
        for fd in (self.ready_fd,):
            with contextlib.suppress(OSError):
                os.close(fd)


def _raise_failure(lines: list[str]) -> None:
    if lines and lines[0].startswith("!"):
        reason, _, message = lines[0][1:].partition(" ")
        try:
            failure = FailureReason(reason)
        except ValueError:
            failure = FailureReason.INTERNAL
        raise RuntimeFailure(failure, message)


async def _read_line(fd: int) -> bytes:
    """Read ``fd`` up to and with the first newline (nothing after it), or to end-of-file."""
    loop = asyncio.get_running_loop()
    data = bytearray()
    done: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        # One byte at a time: what follows the line belongs to the next reader.
        try:
            chunk = os.read(fd, 1)
        except BlockingIOError:
            return
        except OSError as exc:
            if not done.done():
                done.set_exception(exc)
            return
        data.extend(chunk)
        if (not chunk or chunk == b"\n") and not done.done():
            done.set_result(None)

    os.set_blocking(fd, False)
    loop.add_reader(fd, on_readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
    return bytes(data)


async def read_to_eof(fd: int) -> bytes:
    """What the pipe ``fd`` carries until its writers close it, read on the event loop."""
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    done: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError as exc:
            chunk = b""
            if not done.done():
                done.set_exception(exc)
        if chunk:
            chunks.append(chunk)
        elif not done.done():
            done.set_result(None)

    os.set_blocking(fd, False)
    loop.add_reader(fd, on_readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
    return b"".join(chunks)


async def start_sandbox_process(launch: AgentLaunch, python: str = "") -> StartedSandbox:
    """Start the sandbox's PID 1 and return once a pidfd holds it (not yet ready)."""
    ready_read, ready_write = os.pipe2(os.O_CLOEXEC)
    plan = marshal.dumps(launch.plan(ready_write)).hex()
    try:
        helper = await asyncio.create_subprocess_exec(
            python or sys.executable,
            "-S",
            "-E",
            str(SANDBOX_INIT),
            plan,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=(ready_write,),
            start_new_session=True,  # no signal to the service's group reaches the sandbox
            cwd="/",
            env={},  # nothing of the service's environment reaches the sandbox
        )
    except BaseException:
        os.close(ready_read)
        raise
    finally:
        os.close(ready_write)
    try:
        assert helper.stdout is not None and helper.stdin is not None
        line = await asyncio.wait_for(helper.stdout.readline(), _HELPER_TIMEOUT_S)
        if not line:
            # The helper failed before forking: the reason is on the ready pipe or stderr.
            stderr = await helper.stderr.read() if helper.stderr else b""
            await helper.wait()
            early = StartedSandbox(0, 0, -1, ready_read)
            try:
                await early.wait_ready(_HELPER_TIMEOUT_S)
            except RuntimeFailure as failure:
                if failure.reason is not FailureReason.AGENT_EXITED:
                    raise
            raise RuntimeFailure(
                FailureReason.INTERNAL,
                f"sandbox setup failed: {stderr.decode(errors='replace').strip()[-2000:]}",
            )
        pid = int(line)
        # The helper has not exited, so the child cannot have been reaped: pid is still it.
        start_time = process_start_time(pid) or 0
        pidfd = open_pidfd(pid, start_time) if start_time else None
        helper.stdin.close()
        await helper.wait()
    except BaseException:
        os.close(ready_read)
        with contextlib.suppress(ProcessLookupError):
            helper.kill()
        raise
    if pidfd is None:
        # The child died at once (setup failed): its message is on the pipe.
        early = StartedSandbox(pid, start_time, -1, ready_read)
        try:
            await early.wait_ready(_HELPER_TIMEOUT_S)
        finally:
            early.close()
        raise RuntimeFailure(FailureReason.INTERNAL, "the sandbox's first process vanished")
    return StartedSandbox(pid, start_time, pidfd, ready_read)
