"""Host processes by identity: a pid plus its start time, and pidfds to watch and signal them."""

from __future__ import annotations

import contextlib
import os
import signal

__all__ = ["open_pidfd", "process_start_time", "signal_pidfd"]


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
