"""The worker group of a job: rank processes the trainer service starts and drives.

The service process is the controller: it never trains. `WorkerGroup.start` starts one
process per rank (``python -m orchard.trainer.rank``, in a session of its own so a signal
meant for the service does not reach it), each with one end of a socket pair; the ranks form a
torch.distributed group on a free port of 127.0.0.1 and build their DeepSpeed engines.
`call` sends the same command to every rank and returns rank 0's answer.

A rank that dies (killed, out of memory, crashed) closes its socket: a call in flight, or the
next one, raises `RankLost` naming the rank, its pid and how it ended, and the whole group is
stopped, since the other ranks may be stuck in a collective that will never complete.
`exited()` lets a caller notice the death of an idle group (a pidfd per rank becomes
readable). `close` asks every rank to exit, then terminates and kills what is left, and reaps
every process: no rank outlives its group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any

from orchard.trainer.distributed import free_port
from orchard.trainer.rank import RankFault, RankReady, RankSetup

__all__ = ["RankError", "RankLost", "WorkerGroup", "WorkerGroupConfig"]

log = logging.getLogger(__name__)


class RankError(Exception):
    """A command failed in a rank; `fault` says how (the same on every rank when the input
    was at fault)."""

    def __init__(self, rank: int, fault: RankFault) -> None:
        super().__init__(fault.message)
        self.rank = rank
        self.fault = fault


class RankLost(RuntimeError):
    """A rank process ended (or stopped answering) while its group was running: the group is
    stopped and cannot be used again."""


@dataclass(frozen=True, slots=True)
class WorkerGroupConfig:
    ranks: int = 1
    start_timeout_s: float = 600.0
    """How long the ranks may take to answer their setup (model load, engine build)."""
    stop_timeout_s: float = 10.0
    """How long a rank may take to exit when told before it is terminated, then killed."""
    fault_grace_s: float = 30.0
    """After one rank reports an error, how long the others may take to answer before the
    group counts as broken (they may be waiting in a collective for the failed rank)."""
    threads_per_rank: int = 0
    """torch CPU threads per rank; 0: the machine's cores divided by the ranks."""


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "stopped answering"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen[bytes]
    conn: Connection

    @property
    def pid(self) -> int:
        return self.process.pid


class WorkerGroup:
    """The rank processes of one job (see the module docstring)."""

    def __init__(self, name: str, ranks: list[_Rank], config: WorkerGroupConfig) -> None:
        self.name = name
        self.config = config
        self._ranks = ranks
        self._lock = threading.Lock()
        self._closed = False
        self.lost: str | None = None
        """Why the group was stopped by a fault (None while it works)."""

    # -- start -----------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        name: str,
        setup: RankSetup,
        config: WorkerGroupConfig,
        *,
        env: dict[str, str] | None = None,
    ) -> tuple[WorkerGroup, RankReady]:
        """Start `config.ranks` processes with `setup` (its rank, world and port are set per
        rank) and wait until every one is ready; returns rank 0's readiness. Raises `RankError`
        (a rank could not build its engine) or `RankLost`; nothing is left running then."""
        world = config.ranks
        threads = config.threads_per_rank or max(1, (os.cpu_count() or 1) // world)
        port = free_port()
        child_env = {**os.environ, **(env or {})}
        ranks: list[_Rank] = []
        group = cls(name, ranks, config)
        try:
            for rank in range(world):
                ours, theirs = Pipe(duplex=True)
                try:
                    process = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "orchard.trainer.rank",
                            "--conn-fd",
                            str(theirs.fileno()),
                        ],
                        pass_fds=(theirs.fileno(),),
                        env=child_env,
                        start_new_session=True,
                    )
                finally:
                    theirs.close()
                ranks.append(_Rank(rank, process, ours))
                ours.send(
                    replace(
                        setup,
                        rank=rank,
                        world_size=world,
                        master_addr="127.0.0.1",
                        master_port=port,
                        threads=threads,
                    )
                )
            ready = group._gather(config.start_timeout_s, "start")
        except BaseException:
            group.close()
            raise
        log.info(
            "worker group started",
            extra={"group": name, "ranks": world, "pids": [r.pid for r in ranks]},
        )
        first: RankReady = ready[0]
        return group, first

    # -- use -------------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self._ranks]

    @property
    def size(self) -> int:
        return len(self._ranks)

    def call(self, command: str, **arguments: Any) -> Any:
        """Run `command` on every rank; rank 0's answer. Raises `RankError` when the command
        failed in a rank and `RankLost` when a rank died (the group is then closed)."""
        with self._lock:
            if self._closed:
                raise RankLost(self.lost or f"the worker group of {self.name} is closed")
            try:
                for r in self._ranks:
                    r.conn.send((command, arguments))
            except OSError:
                self._lose(self._dead_rank(), f"while sending {command!r}")
            return self._gather(None, command)[0]

    def exited(self) -> Sequence[int]:
        """One descriptor per rank that becomes readable when the process exits (pidfds)."""
        return [os.pidfd_open(r.pid) for r in self._ranks]

    def check(self) -> str | None:
        """Why the group is broken (a rank exited) or None; closes it when broken."""
        if self._closed:
            return self.lost
        for r in self._ranks:
            if r.process.poll() is not None:
                with self._lock:
                    if not self._closed:
                        self._lose(r, "while idle", raise_=False)
                return self.lost
        return None

    # -- stop ------------------------------------------------------------------------------

    def close(self) -> None:
        """Ask every rank to exit, then terminate and kill what is left; reap all. Idempotent."""
        if self._closed and all(r.process.returncode is not None for r in self._ranks):
            return
        self._closed = True
        for r in self._ranks:
            with contextlib.suppress(OSError):
                r.conn.send(("close", {}))
        _stop(self._ranks, self.config.stop_timeout_s)
        for r in self._ranks:
            r.conn.close()

    # -- internals -------------------------------------------------------------------------

    def _gather(self, timeout: float | None, doing: str) -> list[Any]:
        """Every rank's answer to the command just sent, by rank."""
        answers: dict[int, Any] = {}
        fault: RankError | None = None
        deadline = None if timeout is None else time.monotonic() + timeout
        by_conn = {id(r.conn): r for r in self._ranks}
        while len(answers) < len(self._ranks):
            pending = [r.conn for r in self._ranks if r.rank not in answers]
            if fault is not None:
                grace = time.monotonic() + self.config.fault_grace_s
                deadline = grace if deadline is None else min(deadline, grace)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(pending, timeout=left)
            if not ready:
                late = next(r for r in self._ranks if r.rank not in answers)
                if fault is not None:
                    self._lose(late, f"after rank {fault.rank} failed in {doing!r}: {fault}")
                self._lose(late, f"in {doing!r}: no answer within {timeout:.0f} s")
            for conn in ready:
                r = by_conn[id(conn)]
                try:
                    status, value = r.conn.recv()
                except (EOFError, OSError):
                    self._lose(r, f"in {doing!r}")
                answers[r.rank] = value
                if status == "error" and fault is None:
                    fault = RankError(r.rank, value)
        if fault is not None:
            raise fault
        return [answers[k] for k in range(len(self._ranks))]

    def _dead_rank(self) -> _Rank:
        for r in self._ranks:
            if r.process.poll() is not None:
                return r
        return self._ranks[0]

    def _lose(self, r: _Rank, when: str, *, raise_: bool = True) -> None:
        """Record why the group broke, stop every rank, and raise `RankLost`."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.process.wait(timeout=1.0)
        how = _describe_exit(r.process.returncode)
        self.lost = (
            f"rank {r.rank} of {len(self._ranks)} (pid {r.pid}) {how} {when}; the job's "
            "other ranks were stopped"
        )
        log.error("worker group %s lost: %s", self.name, self.lost)
        self._closed = True
        _stop(self._ranks, 0.0)
        for other in self._ranks:
            other.conn.close()
        if raise_:
            raise RankLost(self.lost)


def _stop(ranks: list[_Rank], grace_s: float) -> None:
    """Wait up to `grace_s` for the ranks to exit, then SIGTERM, then SIGKILL; reap each."""
    _wait_all(ranks, grace_s)
    for r in ranks:
        if r.process.poll() is None:
            r.process.terminate()
    _wait_all(ranks, 5.0)
    for r in ranks:
        if r.process.poll() is None:
            r.process.kill()
        r.process.wait()


def _wait_all(ranks: list[_Rank], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for r in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.process.wait(timeout=max(0.0, deadline - time.monotonic()))
