"""``--listen-dir-fd N``: the agent binds its socket through a directory descriptor (one outside
its root, in a sandbox) and closes that descriptor once bound, so it keeps no way out."""

from __future__ import annotations

import os
import select
import subprocess
from pathlib import Path
from typing import Any

import grpc

from orchard.inagent.v1 import inagent_service_pb2, inagent_service_pb2_grpc
from orchard.types.v1 import exec_pb2

TIMEOUT_S = 15.0


def read_to_eof(fd: int, timeout: float) -> bytes:
    """What the agent writes on its ready pipe until it closes it."""
    chunks = []
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        if not poller.poll(timeout * 1000):
            raise TimeoutError("no end of file on the ready pipe")
        chunk = os.read(fd, 4096)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_the_agent_binds_through_the_descriptor_and_closes_it(procs: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dir_fd = os.open(run_dir, os.O_PATH | os.O_DIRECTORY)
    read_end, write_end = os.pipe()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
    try:
        process = subprocess.Popen(
            [
                *procs.agent_command(),
                "--grace-period-s",
                "1",
                "--listen",
                f"unix:/proc/self/fd/{dir_fd}/agent.sock",
                "--listen-dir-fd",
                str(dir_fd),
                "--ready-fd",
                str(write_end),
                "--working-dir",
                str(tmp_path),
            ],
            pass_fds=(write_end, dir_fd),
            stdin=subprocess.DEVNULL,
            stderr=(tmp_path / "agent.log").open("wb"),
            env=env,
        )
    finally:
        os.close(write_end)
        os.close(dir_fd)
    try:
        read_to_eof(read_end, TIMEOUT_S)
        socket = run_dir / "agent.sock"
        assert socket.is_socket(), (tmp_path / "agent.log").read_text()
        # Bound: the agent no longer holds the directory.
        assert not os.path.lexists(f"/proc/{process.pid}/fd/{dir_fd}")
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            reply = inagent_service_pb2_grpc.AgentServiceStub(channel).Exec(
                inagent_service_pb2.ExecRequest(
                    command=exec_pb2.Command(shell=f"test -e /proc/self/fd/{dir_fd}/agent.sock")
                ),
                timeout=10,
            )
        assert reply.result.status.exit_code == 1  # commands never had it either
    finally:
        os.close(read_end)
        stop(process)
