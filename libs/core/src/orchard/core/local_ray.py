"""A Ray a service starts on its own machine, and the processes it leaves.

The rollout service (rollouts on Ray actors) and the trainer (ranks on Ray actors) both start a
local Ray when no cluster address is configured. Such a Ray must bind to 127.0.0.1 (not the
machine's external address), run without auth tokens or usage reporting, and leave no process
behind when the service closes. Ray itself is not a dependency of orchard-core: `import_ray`
imports it when called and says which extra installs it.

The process helpers read /proc (Linux), so they need no psutil.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "RAY_LOCAL_ENV",
    "alive",
    "children",
    "descendants",
    "end_processes",
    "import_ray",
]

log = logging.getLogger(__name__)

RAY_LOCAL_ENV = {
    # A local Ray on 127.0.0.1 (not the machine's external address), without auth tokens or
    # usage reporting.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def import_ray(*, local: bool, extra: str) -> Any:
    """Ray; for a local Ray, with `RAY_LOCAL_ENV` set first (Ray reads it at import, and the
    processes it starts read it again). ``extra`` names what installs Ray, for the error."""
    if local:
        for key, value in RAY_LOCAL_ENV.items():
            os.environ.setdefault(key, value)
    try:
        ray = importlib.import_module("ray")
    except ImportError as exc:
        raise RuntimeError(f"Ray is not installed: pip install '{extra}'") from exc
    if local and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        # Imported before the variable was set: its node address would be the machine's
        # external one; this is what the variable sets at import.
        constants: Any = importlib.import_module("ray._private.ray_constants")
        constants.ENABLE_RAY_CLUSTER = False
    return ray


def _state_and_parent(stat: str) -> tuple[str, int]:
    # The command name may hold spaces and parentheses: fields follow the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0], int(fields[1])


def _parents() -> dict[int, int]:
    """The parent of every live (not zombie) process; empty where there is no /proc."""
    parents: dict[int, int] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return parents
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, parent = _state_and_parent((entry / "stat").read_text())
        except OSError:
            continue
        if state != "Z":
            parents[int(entry.name)] = parent
    return parents


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state, _ = _state_and_parent(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return False
    return state != "Z"


def children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid``."""
    return {child for child, parent in _parents().items() if parent == pid}


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``."""
    parents = _parents()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def end_processes(pids: Iterable[int], *, timeout_s: float = 15.0, what: str = "Ray") -> None:
    """Wait up to ``timeout_s`` for ``pids`` (processes this service started) to end after a
    shutdown; SIGKILL what is left, with a warning naming ``what`` they belong to."""
    pids = set(pids)
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        if alive(pid):
            log.warning(
                "a process of the local %s (pid %d) outlived its shutdown: killed", what, pid
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
