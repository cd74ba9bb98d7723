"""The exec lane (``--lane``): a real agent runs commands for frames on a Unix socket exactly as
it does for AgentService.Exec, refuses what gRPC refuses with the same status and reason, kills
the command of a caller that hangs up, and checks route credentials by the same rules.

With ``--grpc-on-demand`` the agent serves only its lane (no gRPC server, none of grpc's
threads, its ready report names the lane) until a lane call ``open_grpc`` starts AgentService
where it was told to listen; the listen directory's handle is kept only until then."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchard.inagent.credentials import issue_credential
from orchard.inagent.v1 import exec_lane_pb2 as lane_pb
from orchard.inagent.v1 import inagent_service_pb2 as pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as pb_grpc
from orchard.types.v1 import exec_pb2

HEADER = struct.Struct(">I")
KEY = secrets.token_hex(32)
SANDBOX = "sb-lane-1"


class Lane:
    """A blocking client of the lane's framing, written from the proto's description."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(20)
        self.sock.connect(str(path))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(HEADER.pack(len(data)) + data)

    def send(self, command: exec_pb2.Command, authorization: str = "") -> None:
        request = lane_pb.LaneRequest(
            exec=pb.ExecRequest(command=command), authorization=authorization
        )
        self.send_raw(request.SerializeToString())

    def receive(self) -> lane_pb.LaneResponse | None:
        """The next answer; None when the agent closed the connection."""
        header = self._exactly(HEADER.size)
        if header is None:
            return None
        (size,) = HEADER.unpack(header)
        body = self._exactly(size)
        assert body is not None
        return lane_pb.LaneResponse.FromString(body)

    def call(self, command: exec_pb2.Command, authorization: str = "") -> lane_pb.LaneResponse:
        self.send(command, authorization)
        response = self.receive()
        assert response is not None, "the agent closed the lane"
        return response

    def _exactly(self, size: int) -> bytes | None:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def _reason(status: status_pb2.Status) -> str:
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if any_pb2.Any.Unpack(detail, info):
            return info.reason
    return ""


def _start(launch: Any, tmp_path: Path, *args: str, **kwargs: Any) -> tuple[Any, Path]:
    lane = tmp_path / f"lane{len(list(tmp_path.glob('lane*')))}.sock"
    agent = launch("--lane", f"unix:{lane}", *args, **kwargs)
    return agent, lane


def test_the_lane_runs_commands_as_exec_does(launch: Any, tmp_path: Path) -> None:
    agent, path = _start(launch, tmp_path)
    lane = Lane(path)
    try:
        command = exec_pb2.Command(shell="printf out; printf err >&2; exit 3")
        answer = lane.call(command)
        assert answer.WhichOneof("outcome") == "exec"
        with grpc.insecure_channel(agent.address) as channel:
            by_grpc = pb_grpc.AgentServiceStub(channel).Exec(pb.ExecRequest(command=command))
        for result in (answer.exec.result, by_grpc.result):
            assert (result.stdout, result.stderr, result.status.exit_code) == (b"out", b"err", 3)
        # One connection serves call after call, and errors do not end it.
        missing = lane.call(exec_pb2.Command(argv=["no-such-program-x"]))
        assert missing.error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert "'no-such-program-x'" in missing.error.message
        assert _reason(missing.error) == "EXECUTABLE_NOT_FOUND"
        bad = lane.call(exec_pb2.Command())
        assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        for n in range(20):
            result = lane.call(exec_pb2.Command(argv=["echo", str(n)])).exec.result
            assert result.stdout == f"{n}\n".encode()
    finally:
        lane.close()


def test_a_frame_that_does_not_parse_is_refused_and_the_lane_closed(
    launch: Any, tmp_path: Path
) -> None:
    _, path = _start(launch, tmp_path)
    lane = Lane(path)
    lane.send_raw(b"\xff\xff\xff")
    answer = lane.receive()
    assert answer is not None
    assert answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert _reason(answer.error) == "MALFORMED_REQUEST"
    assert lane.receive() is None
    lane.close()
    # A request without a command is refused, and the connection stays.
    lane = Lane(path)
    lane.send_raw(lane_pb.LaneRequest().SerializeToString())
    answer = lane.receive()
    assert answer is not None and answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "exec" in answer.error.message
    assert lane.call(exec_pb2.Command(argv=["true"])).HasField("exec")
    lane.close()


def test_a_frame_over_the_limit_is_refused_unread(launch: Any, tmp_path: Path) -> None:
    _, path = _start(launch, tmp_path, "--set", "server.max_message_bytes=40000000")
    lane = Lane(path)
    lane.sock.sendall(HEADER.pack(2**32 - 1))  # 4 GiB announced, nothing sent
    answer = lane.receive()
    assert answer is not None
    assert answer.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "max_message_bytes" in answer.error.message
    assert lane.receive() is None
    lane.close()


def test_a_caller_that_hangs_up_has_its_command_killed(
    launch: Any, tmp_path: Path, procs: Any
) -> None:
    agent, path = _start(launch, tmp_path)
    pid_file = agent.working_dir / "pid"
    lane = Lane(path)
    lane.send(
        exec_pb2.Command(
            shell=f"echo $$ > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}; exec sleep 60"
        )
    )
    assert procs.wait_until(pid_file.exists, 10)
    pid = int(pid_file.read_text())
    assert procs.is_alive(pid)
    lane.close()
    assert procs.wait_until(lambda: not procs.is_alive(pid), 10), "the command outlived its caller"
    # The agent serves the next caller.
    lane = Lane(path)
    assert lane.call(exec_pb2.Command(argv=["true"])).exec.result.status.exit_code == 0
    lane.close()


def _credential(sandbox_id: str = SANDBOX, expire: float | None = None) -> str:
    expire = time.time() + 60 if expire is None else expire
    return issue_credential(KEY.encode(), sandbox_id, "t", int(expire), os.urandom(16))


@pytest.mark.parametrize("required", [False, True])
def test_the_lane_checks_credentials_as_agent_service_does(
    launch: Any, tmp_path: Path, required: bool
) -> None:
    settings = ("--set", "require_credential=true") if required else ()
    _, path = _start(
        launch,
        tmp_path,
        *settings,
        env={"ORCHARD_AGENT_KEY": KEY, "ORCHARD_AGENT_SANDBOX_ID": SANDBOX},
    )
    lane = Lane(path)
    true = exec_pb2.Command(argv=["true"])
    try:
        assert lane.call(true, f"Bearer {_credential()}").HasField("exec")
        other = lane.call(true, f"Bearer {_credential('sb-other')}")
        assert other.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert _reason(other.error) == "CREDENTIAL_WRONG_SANDBOX"
        expired = lane.call(true, f"Bearer {_credential(expire=time.time() - 5)}")
        assert expired.error.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        forged = _credential()[:-4] + "AAAA"
        assert (
            lane.call(true, f"Bearer {forged}").error.code
            == (grpc.StatusCode.UNAUTHENTICATED.value[0])
        )
        assert lane.call(true, "Basic abc").error.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        none = lane.call(true)
        if required:
            assert none.error.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
            assert "route credential" in none.error.message
        else:
            assert none.HasField("exec")
    finally:
        lane.close()


GRPC_THREADS = ("grpc_global_tim", "event_engine")
"""Name prefixes of the threads grpc's core starts with its first server."""


class OnDemandAgent:
    """An agent started as the local runtime starts one: its sockets in a directory it reaches
    through an inherited descriptor, readiness on a pipe."""

    def __init__(
        self, command: list[str], directory: Path, *args: str, env: dict[str, str] | None = None
    ) -> None:
        self.directory = directory
        (directory / "work").mkdir()
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        ready_read, ready_write = os.pipe()
        self.dir_fd = dir_fd
        self.log = directory / "agent.log"
        command = [
            *command,
            "--listen",
            f"unix:/proc/self/fd/{dir_fd}/agent.sock",
            "--lane",
            f"unix:/proc/self/fd/{dir_fd}/agent.lane",
            "--listen-dir-fd",
            str(dir_fd),
            "--ready-fd",
            str(ready_write),
            "--working-dir",
            str(directory / "work"),
            "--grpc-on-demand",
            "true",
            *args,
        ]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=log,
                env=clean | (env or {}),
                pass_fds=(dir_fd, ready_write),
            )
        os.close(ready_write)
        os.close(dir_fd)
        with os.fdopen(ready_read, "rb") as ready:
            self.ready_lines = ready.read().decode().splitlines()

    @property
    def socket(self) -> Path:
        return self.directory / "agent.sock"

    def grpc_threads(self) -> list[str]:
        names = []
        for task in os.listdir(f"/proc/{self.process.pid}/task"):
            name = Path(f"/proc/{self.process.pid}/task/{task}/comm").read_text().strip()
            if name.startswith(GRPC_THREADS):
                names.append(name)
        return names

    def holds_listen_dir(self) -> bool:
        return any(
            os.readlink(f"/proc/{self.process.pid}/fd/{fd}") == str(self.directory)
            for fd in os.listdir(f"/proc/{self.process.pid}/fd")
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def on_demand(procs: Any, tmp_path: Path) -> Iterator[Callable[..., OnDemandAgent]]:
    """Start agents with ``--grpc-on-demand``; each is stopped at the end of the test."""
    started: list[OnDemandAgent] = []

    def make(*args: str, env: dict[str, str] | None = None) -> OnDemandAgent:
        directory = tmp_path / f"on-demand{len(started)}"
        directory.mkdir()
        agent = OnDemandAgent(procs.agent_command(), directory, *args, env=env)
        started.append(agent)
        return agent

    yield make
    for agent in started:
        agent.stop()


def _open(lane: Lane, authorization: str = "") -> lane_pb.LaneResponse:
    request = lane_pb.LaneRequest(open_grpc=lane_pb.OpenGrpcRequest(), authorization=authorization)
    lane.send_raw(request.SerializeToString())
    answer = lane.receive()
    assert answer is not None, "the agent closed the lane"
    return answer


def test_on_demand_the_agent_serves_the_lane_alone_until_asked_to_open_grpc(
    on_demand: Any,
) -> None:
    agent = on_demand()
    try:
        assert agent.ready_lines == [f"unix:/proc/self/fd/{agent.dir_fd}/agent.lane"]
        assert not agent.socket.exists()
        assert agent.grpc_threads() == []
        assert agent.holds_listen_dir()  # kept until gRPC has bound there
        lane = Lane(agent.directory / "agent.lane")
        echo = lane.call(exec_pb2.Command(argv=["echo", "lane"]))
        assert echo.exec.result.stdout == b"lane\n"
        assert agent.grpc_threads() == [] and not agent.socket.exists()

        opened = _open(lane)
        assert opened.WhichOneof("outcome") == "grpc"
        assert list(opened.grpc.addresses) == [f"unix:/proc/self/fd/{agent.dir_fd}/agent.sock"]
        assert agent.socket.exists()
        assert not agent.holds_listen_dir()  # let go once bound
        assert agent.grpc_threads() != []
        with grpc.insecure_channel(f"unix:{agent.socket}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.AgentServiceStub(channel)
            reply = stub.Exec(pb.ExecRequest(command=exec_pb2.Command(argv=["echo", "grpc"])))
            assert reply.result.stdout == b"grpc\n"
        # Asked again: the same server, at once; the lane still runs commands.
        assert list(_open(lane).grpc.addresses) == list(opened.grpc.addresses)
        assert lane.call(exec_pb2.Command(argv=["true"])).HasField("exec")
        lane.close()
    finally:
        agent.stop()
    assert agent.process.returncode == 0


def test_concurrent_open_grpc_calls_share_one_server_and_close_the_directory_once(
    on_demand: Any,
) -> None:
    agent = on_demand()
    lanes = [Lane(agent.directory / "agent.lane") for _ in range(4)]
    try:
        request = lane_pb.LaneRequest(open_grpc=lane_pb.OpenGrpcRequest()).SerializeToString()
        for lane in lanes:  # all asked before any answer is read
            lane.send_raw(request)
        answers = [lane.receive() for lane in lanes]
        assert all(a is not None and a.HasField("grpc") for a in answers), answers
        assert not agent.holds_listen_dir()
        # Every descriptor the agent still needs is intact: each lane and gRPC still serve.
        for n, lane in enumerate(lanes):
            result = lane.call(exec_pb2.Command(argv=["echo", str(n)])).exec.result
            assert result.stdout == f"{n}\n".encode()
        with grpc.insecure_channel(f"unix:{agent.socket}") as channel:
            stub = pb_grpc.AgentServiceStub(channel)
            assert stub.GetAgentInfo(pb.GetAgentInfoRequest(), timeout=10).version
    finally:
        for lane in lanes:
            lane.close()


def test_open_grpc_obeys_the_lanes_credential_rules(on_demand: Any) -> None:
    agent = on_demand(
        "--set",
        "require_credential=true",
        env={"ORCHARD_AGENT_KEY": KEY, "ORCHARD_AGENT_SANDBOX_ID": SANDBOX},
    )
    lane = Lane(agent.directory / "agent.lane")
    try:
        for authorization in ("", f"Bearer {_credential('sb-other')}", "Basic abc"):
            refused = _open(lane, authorization)
            assert refused.WhichOneof("outcome") == "error"
            assert refused.error.code in (
                grpc.StatusCode.UNAUTHENTICATED.value[0],
                grpc.StatusCode.PERMISSION_DENIED.value[0],
            )
        assert not agent.socket.exists() and agent.grpc_threads() == []
        assert _open(lane, f"Bearer {_credential()}").HasField("grpc")
        assert agent.socket.exists()
    finally:
        lane.close()


@pytest.mark.parametrize("extra", [(), ("--set", "env.X=1")], ids=["quick", "validated"])
def test_grpc_on_demand_without_a_lane_is_refused(
    procs: Any, tmp_path: Path, extra: tuple[str, ...]
) -> None:
    result = subprocess.run(
        [
            *procs.agent_command(),
            "--listen",
            f"unix:{tmp_path / 'a.sock'}",
            "--grpc-on-demand",
            "true",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "grpc_on_demand needs a lane" in result.stderr
