"""Ranks on standing worker Pods (``workers.kind: pods``): the controller's side.

`PodRanks` is the transport `workers.WorkerGroup` uses in place of local processes: a job of
N ranks takes the first N workers of ``workers.pods.endpoints`` that accept it (a worker runs
one job at a time, see `orchard.trainer.rank_worker`), rank 0's worker host is the
torch.distributed rendezvous address. Everything else (commands, answers, faults, closing) is
the group's own logic; a remote rank only differs in how its end is learnt: the worker sends
the rank's exit status before it closes the connection, so a killed rank is named as a local
one is ("rank 1 of 2 (pod HOST:PORT, pid 42) was killed by SIGKILL ...").

The ranks read and write the folders the controller names (the job's scratch folder under
``weights.scratch_dir``, model folders and the artifact cache), so those must be on a volume
the trainer and every worker Pod mount at the same path (the chart uses the shared artifacts
claim).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from orchard.trainer.rank_worker import AUTH_TIMEOUT_S, read_key, set_receive_timeout
from orchard.trainer.workers import (
    RankHandle,
    RankLost,
    WorkerGroupConfig,
    describe_exit,
)

__all__ = ["PodRanks", "WorkersUnavailable", "split_endpoint"]


class WorkersUnavailable(RankLost):
    """Fewer workers accepted a job than it has ranks; the message names the others."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); raises `ValueError` naming the endpoint."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker endpoint {endpoint!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class _PodRank(RankHandle):
    """A rank a worker runs; its connection is the worker's."""

    def __init__(self, rank: int, endpoint: str, conn: Connection, pid: int) -> None:
        self.rank = rank
        self.endpoint = endpoint
        self.conn = conn
        self._pid = pid
        self._status: int | None = None
        self._gone = False

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def where(self) -> str:
        return f"pod {self.endpoint}, pid {self._pid}"

    def recv(self) -> Any:
        if self._gone:
            raise EOFError
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self._gone = True
            raise
        if isinstance(message, tuple) and len(message) == 2 and message[0] == "exited":
            self._status = int(message[1])
            self._gone = True
            raise EOFError
        return message

    def ended(self) -> bool:
        try:
            while not self._gone and self.conn.poll(0):
                self.recv()  # nothing but the exit status arrives while the group is idle
        except (EOFError, OSError):
            pass
        return self._gone

    def wait(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._gone:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            try:
                if self.conn.poll(left):
                    self.recv()
            except (EOFError, OSError):
                return

    def terminate(self) -> None:
        # The worker ends a rank whose controller went away (SIGTERM, then SIGKILL).
        self._gone = True
        self.conn.close()

    def kill(self) -> None:
        self.terminate()

    def how(self) -> str:
        if self._status is not None:
            return describe_exit(self._status)
        if self._gone:
            return "lost its worker (the worker Pod stopped or the network failed)"
        return describe_exit(None)

    def exit_fd(self) -> int:
        return os.dup(self.conn.fileno())

    def release(self) -> None:
        self._gone = True
        self.conn.close()


class PodRanks:
    """Ranks on the workers at `endpoints` (``HOST:PORT``), which prove `key_file`'s key; the
    rendezvous is `rendezvous_port` on rank 0's worker (0: a free port that worker names)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        key_file: str,
        *,
        rendezvous_port: int = 0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        for endpoint in endpoints:
            split_endpoint(endpoint)
        self.endpoints = list(endpoints)
        self.key_file = key_file
        self.rendezvous_port = rendezvous_port
        self.connect_timeout_s = connect_timeout_s

    def threads(self, config: WorkerGroupConfig) -> int:
        return config.threads_per_rank  # 0: torch's default in the worker Pod

    def launch(self, world: int, ranks: list[RankHandle]) -> tuple[str, int]:
        key = read_key(self.key_file)
        if world > len(self.endpoints):
            raise WorkersUnavailable(
                f"the job has {world} ranks but workers.pods.endpoints names "
                f"{len(self.endpoints)} worker(s); give fewer ranks or run more workers"
            )
        refused: list[str] = []
        taken: list[tuple[str, int]] = []  # (endpoint, its free port) by rank
        for endpoint in self.endpoints:
            if len(ranks) == world:
                break
            try:
                conn, hello = self._connect(endpoint, key)
            except _Refused as exc:
                refused.append(f"{endpoint} ({exc})")
                continue
            ranks.append(_PodRank(len(ranks), endpoint, conn, int(hello["pid"])))
            taken.append((endpoint, int(hello["port"])))
        if len(ranks) < world:
            raise WorkersUnavailable(
                f"the job needs {world} workers and only {len(ranks)} of "
                f"workers.pods.endpoints took it; not available: {'; '.join(refused)}"
            )
        endpoint, free = taken[0]
        return split_endpoint(endpoint)[0], self.rendezvous_port or free

    def _connect(self, endpoint: str, key: bytes) -> tuple[Connection, dict[str, Any]]:
        host, port = split_endpoint(endpoint)
        try:
            sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
        except OSError as exc:
            raise _Refused(f"did not answer: {_reason(exc)}") from None
        sock.settimeout(None)
        set_receive_timeout(sock, max(self.connect_timeout_s, AUTH_TIMEOUT_S))
        conn = Connection(sock.detach())
        try:
            answer_challenge(conn, key)
            deliver_challenge(conn, key)
            status, value = conn.recv()
        except AuthenticationError:
            conn.close()
            raise _Refused(
                "refused the key: workers.pods.key_file must hold the workers' key"
            ) from None
        except (EOFError, OSError) as exc:
            conn.close()
            raise _Refused(f"closed the connection: {_reason(exc)}") from None
        with socket.socket(fileno=os.dup(conn.fileno())) as raw:
            set_receive_timeout(raw, 0.0)
        if status != "ready":
            conn.close()
            raise _Refused(str(value))
        return conn, value


class _Refused(Exception):
    """A worker did not take the job."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, EOFError):
        return "no answer"
    if isinstance(exc, socket.timeout | TimeoutError | BlockingIOError):
        return "timed out"
    return exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc)
