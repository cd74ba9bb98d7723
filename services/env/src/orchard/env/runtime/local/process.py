"""Host processes by identity: a pid plus its start time, and pidfds to watch and signal them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct

__all__ = ["open_pidfd", "peer_pid", "process_start_time", "signal_pidfd"]

_PEER_TIMEOUT_S = 5.0


def process_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/PID/stat`` (clock ticks after boot), or None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            data = file.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    if fields[0] == b"Z":
        return None  # exited; only its exit status is left for a parent to collect
    return int(fields[19])


def open_pidfd(pid: int, start_time: int) -> int | None:
    """A pidfd for the process ``pid`` started at ``start_time``, or None if it is gone.

    The start time is checked after opening, so a pid reused in between is never mistaken
    for the original.
    """
    if pid <= 0:
        return None
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    if process_start_time(pid) != start_time:
        os.close(fd)
        return None
    return fd


def signal_pidfd(pidfd: int, signum: int = signal.SIGKILL) -> None:
    """Send ``signum`` through the pidfd (never to a reused pid); gone processes are fine."""
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signum)


async def peer_pid(path: str) -> int | None:
    """The pid (in this pid namespace) of the process listening on the Unix socket ``path``,
    from ``SO_PEERCRED``; None when nothing accepts there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    try:
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.sock_connect(sock, path), _PEER_TIMEOUT_S)
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    except (OSError, TimeoutError):
        return None
    finally:
        sock.close()
    pid, _, _ = struct.unpack("3i", credentials)
    return int(pid)
