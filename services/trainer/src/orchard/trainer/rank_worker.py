"""``orchard-trainer worker``: a standing worker that runs one rank of one job at a time.

With ``workers.kind: pods`` the ranks of a job run in worker Pods of their own (a StatefulSet
of the trainer chart), not as children of the trainer service. Each Pod runs this worker: it
listens on a TCP address, and per accepted controller connection starts a fresh
``python -m orchard.trainer.rank`` process (nothing of a job survives into the next) and
relays the connection's messages to it and its answers back, as opaque frames. The controller
side is `pod_workers.PodRanks`.

The exchange on one connection, after the key check:

- the worker answers ``("ready", {"pid": PID, "port": PORT})``: the rank process it started
  and a free port of this host (the rendezvous when this rank is rank 0 and no fixed port is
  configured), or ``("busy", MESSAGE)`` and closes the connection when a rank of another job
  runs here (one job at a time per worker);
- then every message is relayed: the `RankSetup`, commands, answers (see `orchard.trainer.rank`);
- when the rank ends, the worker sends ``("exited", STATUS)`` (a negative status is the signal
  that killed it, as with `subprocess`) and closes the connection, so the controller can name
  how the rank ended; when the controller's connection closes first, the worker ends the rank
  (asked to exit by the closed connection, then SIGTERM, then SIGKILL) and is free again.

Authentication: both sides prove that they hold the same shared key (read from a file, a
Kubernetes Secret in the chart) with the HMAC challenge of `multiprocessing.connection`
before anything else is read: the worker unpickles nothing and starts no rank for a peer that
has not proved the key, and the controller unpickles nothing from a worker that has not. A
wrong key is refused and logged. What it does not protect: there is no encryption (no TLS), so
anyone on the network path can read the traffic (model paths, training data, answers), and a
peer that holds the key can run any code in the worker (the messages are pickles). Keep the key
secret, and let the network admit only the trainer Pod to the workers (the chart's
NetworkPolicy does).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Pipe, answer_challenge, deliver_challenge, wait
from pathlib import Path
from types import FrameType

from orchard.trainer.distributed import free_port

__all__ = [
    "AUTH_TIMEOUT_S",
    "MIN_KEY_BYTES",
    "RankWorker",
    "WorkerKeyError",
    "read_key",
    "run_worker",
    "set_receive_timeout",
]

log = logging.getLogger(__name__)

MIN_KEY_BYTES = 16
"""The shortest shared key accepted."""

AUTH_TIMEOUT_S = 10.0
"""How long a peer may take to answer the key check (a silent peer holds up the next)."""


def start_rank_process(
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], Connection]:
    """Start one ``python -m orchard.trainer.rank`` in a session of its own (a signal meant for
    its parent does not reach it), holding one end of a socket pair; returns the process and
    the other end."""
    ours, theirs = Pipe(duplex=True)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "orchard.trainer.rank", "--conn-fd", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            start_new_session=True,
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return process, ours


class WorkerKeyError(ValueError):
    """The shared key file is missing, unreadable or too short."""


def read_key(path: str | Path) -> bytes:
    """The shared key in file `path` (surrounding whitespace removed)."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise WorkerKeyError(f"the worker key file {str(path)!r} cannot be read: {exc}") from None
    if len(key) < MIN_KEY_BYTES:
        raise WorkerKeyError(
            f"the worker key in {str(path)!r} has {len(key)} bytes; it needs at least "
            f"{MIN_KEY_BYTES} (e.g. `head -c 32 /dev/urandom | base64`)"
        )
    return key


def set_receive_timeout(sock: socket.socket, seconds: float) -> None:
    """Make blocking reads of `sock` fail after `seconds` (0: wait for ever)."""
    whole = int(seconds)
    micro = int((seconds - whole) * 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, micro))


@dataclass
class _Job:
    """The rank this worker runs for the controller of `peer`."""

    peer: str
    process: subprocess.Popen[bytes]
    thread: threading.Thread


class RankWorker:
    """Serves controllers on `listen` (``HOST:PORT``) one at a time (see the module
    docstring). `serve` runs until `stop` (or SIGTERM in `run_worker`)."""

    def __init__(self, listen: str, key: bytes, *, stop_timeout_s: float = 10.0) -> None:
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--listen {listen!r} is not HOST:PORT (e.g. 0.0.0.0:7400)")
        self.key = key
        self.stop_timeout_s = stop_timeout_s
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, int(port)), family=family, backlog=16)
        self.address = "{}:{}".format(*self._socket.getsockname()[:2])
        self._lock = threading.Lock()
        self._job: _Job | None = None
        self._stopping = False

    def serve(self) -> None:
        log.info("trainer worker listening", extra={"address": self.address})
        while not self._stopping:
            try:
                client, peer_address = self._socket.accept()
            except OSError:
                if self._stopping:
                    return
                raise
            peer = "{}:{}".format(*peer_address[:2])
            conn = self._authenticate(client, peer)
            if conn is not None:
                self._take(conn, peer)

    def interrupt(self) -> None:
        """Make `serve` return (safe in a signal handler)."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        """Stop accepting, end the running rank (if any) and wait for its relay to finish."""
        self.interrupt()
        self._socket.close()
        with self._lock:
            job = self._job
        if job is not None:
            _end(job.process, 0.0)
            job.thread.join(timeout=self.stop_timeout_s + 10.0)

    # -- internals -------------------------------------------------------------------------

    def _authenticate(self, client: socket.socket, peer: str) -> Connection | None:
        set_receive_timeout(client, AUTH_TIMEOUT_S)
        conn = Connection(client.detach())
        try:
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
        except AuthenticationError:
            log.warning(
                "refused a controller with a wrong key",
                extra={"peer": peer, "hint": "workers.pods.key_file must hold this worker's key"},
            )
            conn.close()
            return None
        except (EOFError, OSError) as exc:
            # Kubernetes' TCP probes connect and leave: not worth a line at INFO.
            log.debug("%s left before the key check finished: %s", peer, exc)
            conn.close()
            return None
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            set_receive_timeout(sock, 0.0)
        return conn

    def _take(self, conn: Connection, peer: str) -> None:
        with self._lock:
            job = self._job
            if job is not None and job.thread.is_alive():
                log.warning(
                    "refused a second controller: a job runs here",
                    extra={"peer": peer, "running_for": job.peer},
                )
                with contextlib.suppress(OSError):
                    conn.send(
                        (
                            "busy",
                            f"worker {self.address} runs a rank for the controller at "
                            f"{job.peer}; one job at a time per worker",
                        )
                    )
                conn.close()
                return
            try:
                process, ours = start_rank_process()
            except OSError as exc:
                log.error("could not start a rank process: %s", exc)
                conn.close()
                return
            thread = threading.Thread(
                target=self._relay, args=(conn, ours, process, peer), name="rank-relay"
            )
            self._job = _Job(peer, process, thread)
        log.info("rank started", extra={"peer": peer, "rank_pid": process.pid})
        with contextlib.suppress(OSError):  # a controller that is gone: the relay ends the rank
            conn.send(("ready", {"pid": process.pid, "port": free_port("0.0.0.0")}))
        thread.start()

    def _relay(
        self, ctl: Connection, rank: Connection, process: subprocess.Popen[bytes], peer: str
    ) -> None:
        """Pass frames both ways until the rank or the controller is gone; then end the rank
        and tell the controller how it ended."""
        try:
            while True:
                ready = wait([ctl, rank])
                if rank in ready:
                    try:
                        data = rank.recv_bytes()
                    except (EOFError, OSError):
                        break  # the rank ended
                    try:
                        ctl.send_bytes(data)
                    except OSError:
                        break  # the controller is gone
                if ctl in ready:
                    try:
                        data = ctl.recv_bytes()
                    except (EOFError, OSError):
                        break  # the controller is gone (or closed the group)
                    with contextlib.suppress(OSError):
                        rank.send_bytes(data)  # a rank that ended is seen on its own side
        finally:
            rank.close()  # a rank waiting for a command reads EOF and exits
            status = _end(process, self.stop_timeout_s)
            with contextlib.suppress(OSError):
                ctl.send(("exited", status))
            ctl.close()
            log.info("rank ended", extra={"peer": peer, "rank_pid": process.pid, "status": status})


def _end(process: subprocess.Popen[bytes], grace_s: float) -> int:
    """Wait `grace_s` for `process` to exit, then SIGTERM, then SIGKILL; its exit status."""
    for step in (process.terminate, process.kill):
        try:
            return process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                step()
        grace_s = 5.0
    return process.wait()


def run_worker(listen: str, key_file: str, *, stop_timeout_s: float = 10.0) -> int:
    """Run a worker until SIGTERM or SIGINT; the exit status."""
    try:
        key = read_key(key_file)
        worker = RankWorker(listen, key, stop_timeout_s=stop_timeout_s)
    except (WorkerKeyError, ValueError, OSError) as exc:
        print(f"orchard-trainer worker: {exc}", file=sys.stderr)
        return 2

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping on %s", signal.Signals(signum).name)
        worker.interrupt()

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        worker.serve()
    finally:
        worker.stop()
    return 0
