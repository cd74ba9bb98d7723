"""The worker group of a job: rank processes the trainer service starts and drives.

The service process is the controller: it never trains. `WorkerGroup.start` starts one
process per rank through a transport: `LocalRanks` (the default) runs
``python -m orchard.trainer.rank`` as a child process in a session of its own (so a signal
meant for the service does not reach it) with one end of a socket pair, and the ranks meet on
a free port of 127.0.0.1; `pod_workers.PodRanks` has standing worker Pods run them
(``orchard-trainer worker``). Either way the ranks form a torch.distributed group and build
their DeepSpeed engines, and `call` sends the same command to every rank and returns rank 0's
answer.

A rank that dies (killed, out of memory, crashed) closes its connection: a call in flight, or
the next one, raises `RankLost` naming the rank, where it ran and how it ended, and the whole
group is stopped, since the other ranks may be stuck in a collective that will never complete.
`exited()` lets a caller notice the death of an idle group. `close` asks every rank to exit,
then terminates and kills what is left, and reaps every process: no rank outlives its group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

from orchard.trainer.distributed import free_port
from orchard.trainer.rank import RankFault, RankReady, RankSetup
from orchard.trainer.rank_worker import start_rank_process

__all__ = [
    "LocalRanks",
    "RankError",
    "RankHandle",
    "RankLost",
    "RankTransport",
    "WorkerGroup",
    "WorkerGroupConfig",
    "describe_exit",
]

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


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "stopped answering"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


class RankHandle(ABC):
    """One rank process as the group sees it: a connection that carries commands and answers,
    and the means to learn how the process ended and to end it. Only the transport differs
    between a local rank (`LocalRanks`) and one a worker Pod runs
    (`pod_workers.PodRanks`)."""

    rank: int
    conn: Connection
    """Readable when the rank has answered (or ended); the group waits on it."""

    @property
    @abstractmethod
    def pid(self) -> int:
        """The rank's process id (on the worker's host for a remote rank)."""

    @property
    def where(self) -> str:
        """Where the rank runs, for messages."""
        return f"pid {self.pid}"

    def send(self, message: Any) -> None:
        self.conn.send(message)

    def recv(self) -> Any:
        """The next answer; `EOFError` or `OSError` once the rank has ended."""
        return self.conn.recv()

    @abstractmethod
    def ended(self) -> bool:
        """Whether the rank has ended (does not block)."""

    @abstractmethod
    def wait(self, timeout: float | None) -> None:
        """Wait up to `timeout` seconds (None: for ever) for the rank to end."""

    @abstractmethod
    def terminate(self) -> None: ...

    @abstractmethod
    def kill(self) -> None: ...

    @abstractmethod
    def how(self) -> str:
        """How the rank ended (``was killed by SIGKILL``), or that it stopped answering."""

    @abstractmethod
    def exit_fd(self) -> int:
        """A new descriptor that becomes readable when the rank ends; the caller closes it."""

    def release(self) -> None:
        self.conn.close()


class RankTransport(Protocol):
    """Starts the rank processes of a group (locally, or on worker Pods)."""

    def launch(self, world: int, ranks: list[RankHandle]) -> tuple[str, int]:
        """Start `world` ranks, appending each to `ranks` as it starts (so a failure half-way
        leaves the started ones to the caller to stop); the torch.distributed rendezvous
        address and port (rank 0's host)."""
        ...

    def threads(self, config: WorkerGroupConfig) -> int:
        """torch CPU threads per rank (0: torch's default)."""
        ...


@dataclass
class _LocalRank(RankHandle):
    rank: int
    process: subprocess.Popen[bytes]
    conn: Connection

    @property
    def pid(self) -> int:
        return self.process.pid

    def ended(self) -> bool:
        return self.process.poll() is not None

    def wait(self, timeout: float | None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout)

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()

    def how(self) -> str:
        return describe_exit(self.process.returncode)

    def exit_fd(self) -> int:
        return os.pidfd_open(self.process.pid)


class LocalRanks:
    """Ranks as child processes of this one (``python -m orchard.trainer.rank``), each in a
    session of its own and with one end of a socket pair; the rendezvous is a free port of
    127.0.0.1."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = {**os.environ, **(env or {})}

    def threads(self, config: WorkerGroupConfig) -> int:
        return config.threads_per_rank or max(1, (os.cpu_count() or 1) // config.ranks)

    def launch(self, world: int, ranks: list[RankHandle]) -> tuple[str, int]:
        for rank in range(world):
            process, ours = start_rank_process(self.env)
            ranks.append(_LocalRank(rank, process, ours))
        return "127.0.0.1", free_port()


class WorkerGroup:
    """The rank processes of one job (see the module docstring)."""

    def __init__(self, name: str, ranks: list[RankHandle], config: WorkerGroupConfig) -> None:
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
        transport: RankTransport | None = None,
    ) -> tuple[WorkerGroup, RankReady]:
        """Start `config.ranks` ranks with `setup` (its rank, world and port are set per rank)
        and wait until every one is ready; returns rank 0's readiness. The ranks are local
        processes (with `env` added to this one's environment) unless `transport` says
        otherwise. Raises `RankError` (a rank could not build its engine) or `RankLost`;
        nothing is left running then."""
        transport = transport or LocalRanks(env)
        world = config.ranks
        threads = transport.threads(config)
        ranks: list[RankHandle] = []
        group = cls(name, ranks, config)
        try:
            address, port = transport.launch(world, ranks)
            for r in ranks:
                r.send(
                    replace(
                        setup,
                        rank=r.rank,
                        world_size=world,
                        master_addr=address,
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
            extra={"group": name, "ranks": world, "where": [r.where for r in ranks]},
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
                    r.send((command, arguments))
            except OSError:
                self._lose(self._dead_rank(), f"while sending {command!r}")
            return self._gather(None, command)[0]

    def exited(self) -> Sequence[int]:
        """One descriptor per rank that becomes readable when the rank ends (a pidfd locally);
        the caller closes them. A remote rank's descriptor also becomes readable when it
        answers: `check` then finds nothing wrong."""
        return [r.exit_fd() for r in self._ranks]

    def check(self) -> str | None:
        """Why the group is broken (a rank exited) or None; closes it when broken."""
        if self._closed:
            return self.lost
        for r in self._ranks:
            if r.ended():
                with self._lock:
                    if not self._closed:
                        self._lose(r, "while idle", raise_=False)
                return self.lost
        return None

    # -- stop ------------------------------------------------------------------------------

    def close(self) -> None:
        """Ask every rank to exit, then terminate and kill what is left; reap all. Idempotent."""
        if self._closed and all(r.ended() for r in self._ranks):
            return
        self._closed = True
        for r in self._ranks:
            with contextlib.suppress(OSError):
                r.send(("close", {}))
        _stop(self._ranks, self.config.stop_timeout_s)
        for r in self._ranks:
            r.release()

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
                    status, value = r.recv()
                except (EOFError, OSError):
                    self._lose(r, f"in {doing!r}")
                answers[r.rank] = value
                if status == "error" and fault is None:
                    fault = RankError(r.rank, value)
        if fault is not None:
            raise fault
        return [answers[k] for k in range(len(self._ranks))]

    def _dead_rank(self) -> RankHandle:
        for r in self._ranks:
            if r.ended():
                return r
        return self._ranks[0]

    def _lose(self, r: RankHandle, when: str, *, raise_: bool = True) -> None:
        """Record why the group broke, stop every rank, and raise `RankLost`."""
        r.wait(1.0)
        self.lost = (
            f"rank {r.rank} of {len(self._ranks)} ({r.where}) {r.how()} {when}; the job's "
            "other ranks were stopped"
        )
        log.error("worker group %s lost: %s", self.name, self.lost)
        self._closed = True
        _stop(self._ranks, 0.0)
        for other in self._ranks:
            other.release()
        if raise_:
            raise RankLost(self.lost)


def _stop(ranks: list[RankHandle], grace_s: float) -> None:
    """Wait up to `grace_s` for the ranks to exit, then terminate, then kill; reap each."""
    _wait_all(ranks, grace_s)
    for r in ranks:
        if not r.ended():
            r.terminate()
    _wait_all(ranks, 5.0)
    for r in ranks:
        if not r.ended():
            r.kill()
        r.wait(None)


def _wait_all(ranks: list[RankHandle], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for r in ranks:
        r.wait(max(0.0, deadline - time.monotonic()))
