"""Fixtures: a real agent process, a real gRPC channel to it, and helpers to inspect processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchard.inagent.v1 import inagent_service_pb2_grpc

START_TIMEOUT_S = 15.0


def agent_command() -> list[str]:
    """How to start the agent: the console script beside this interpreter, else ``-m``."""
    script = Path(sys.executable).parent / "orchard-inagent"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "orchard.inagent.main"]


def grpcurl_path() -> str | None:
    """The grpcurl binary, looked up in the interpreter's bin directory and then on PATH."""
    return shutil.which("grpcurl", path=f"{Path(sys.executable).parent}{os.pathsep}") or (
        shutil.which("grpcurl")
    )


@dataclass
class AgentProcess:
    """A running ``orchard-inagent`` and how to reach it."""

    process: subprocess.Popen[bytes]
    address: str
    """The first bound address, as a gRPC target."""
    working_dir: Path
    log_path: Path
    start_to_serving_s: float

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait, and SIGKILL if it does not exit; return the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def launch_agent(
    directory: Path,
    *args: str,
    listen: str | None = None,
    prefix: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> AgentProcess:
    """Start an agent whose working dir, socket, address file and log live in ``directory``."""
    work = directory / "work"
    work.mkdir(exist_ok=True)
    address_file = directory / "agent.addr"
    log_path = directory / "agent.log"
    listen = listen or f"unix:{directory / 'agent.sock'}"
    command = [
        *prefix,
        *agent_command(),
        "--listen",
        listen,
        "--address-file",
        str(address_file),
        "--working-dir",
        str(work),
        "--grace-period-s",
        "1",
        *args,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")} | dict(env or {})
    started = time.monotonic()
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=log_file, stdin=subprocess.DEVNULL, env=env
        )
    agent = AgentProcess(process, "", work, log_path, 0.0)
    try:
        deadline = started + START_TIMEOUT_S
        while not address_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent did not bind:\n{agent.log()}")
            time.sleep(0.005)
        agent.address = address_file.read_text().split()[0]
        wait_serving(agent.address, deadline - time.monotonic())
        agent.start_to_serving_s = time.monotonic() - started
    except BaseException:
        agent.stop()
        raise
    return agent


def wait_serving(address: str, timeout: float) -> None:
    """Poll the standard health service until it says SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{address} did not become SERVING")
            time.sleep(0.005)


@pytest.fixture(scope="session")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """One agent for the whole session, on a Unix socket."""
    directory = tmp_path_factory.mktemp("agent")
    process = launch_agent(directory)
    try:
        yield process
    finally:
        process.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def channel(agent: AgentProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(
        agent.address,
        options=[
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ],
    ) as channel:
        yield channel


@pytest.fixture(scope="session")
def stub(channel: grpc.Channel) -> inagent_service_pb2_grpc.AgentServiceStub:
    return inagent_service_pb2_grpc.AgentServiceStub(channel)


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Start extra agents for one test; each is stopped at the end of the test."""
    started: list[AgentProcess] = []

    def start(*args: str, **kwargs: object) -> AgentProcess:
        directory = tmp_path / f"agent{len(started)}"
        directory.mkdir()
        process = launch_agent(directory, *args, **kwargs)  # type: ignore[arg-type]
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


# --- looking at processes (test modules reach these through the ``procs`` fixture)


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` (R, S, Z, ...), or None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()[0]


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    state = process_state(pid)
    return state is not None and state != "Z"


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def children_of(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of every process whose parent is ``pid``."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                children.append((int(entry.name), fields[0]))
    return children


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until true or ``timeout``; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def memory_kib(pid: int, field: str = "VmRSS") -> int:
    """A memory figure of ``pid`` from /proc/PID/status (VmRSS, VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class Procs:
    """Helpers to look at processes, for tests (a fixture, since tests cannot import conftest)."""

    state = staticmethod(process_state)
    is_alive = staticmethod(is_alive)
    group_members = staticmethod(group_members)
    children_of = staticmethod(children_of)
    wait_until = staticmethod(wait_until)
    memory_kib = staticmethod(memory_kib)
    grpcurl = staticmethod(grpcurl_path)
    agent_command = staticmethod(agent_command)


@pytest.fixture(scope="session")
def procs() -> type[Procs]:
    return Procs
