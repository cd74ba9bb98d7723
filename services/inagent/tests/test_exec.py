"""Exec and ExecStream against a real agent process."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2

from orchard.core.errors import error_info
from orchard.inagent.v1 import inagent_service_pb2 as pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as pb_grpc
from orchard.types.v1 import exec_pb2

Stub = pb_grpc.AgentServiceStub


def run(stub: Stub, timeout_s: float | None = None, **command: Any) -> exec_pb2.ExecResult:
    if timeout_s is not None:
        command["timeout"] = duration_pb2.Duration(
            seconds=int(timeout_s), nanos=int((timeout_s % 1) * 1e9)
        )
    reply = stub.Exec(pb.ExecRequest(command=exec_pb2.Command(**command)), timeout=60)
    return reply.result


# --- happy paths


def test_argv_captures_stdout_stderr_and_exit_code(stub: Stub) -> None:
    result = run(stub, argv=["sh", "-c", "printf out; printf err >&2; exit 7"])
    assert (result.stdout, result.stderr) == (b"out", b"err")
    assert result.status.WhichOneof("termination") == "exit_code"
    assert result.status.exit_code == 7
    assert (result.status.stdout_bytes, result.status.stderr_bytes) == (3, 3)
    assert not result.status.timed_out
    assert not result.status.stdout_truncated
    assert result.status.duration.ToTimedelta().total_seconds() > 0


def test_exit_code_zero_is_reported(stub: Stub) -> None:
    result = run(stub, argv=["true"])
    assert result.status.WhichOneof("termination") == "exit_code"
    assert result.status.exit_code == 0


def test_shell_string_runs_in_sh(stub: Stub) -> None:
    result = run(stub, shell="echo $((6 * 7)) | tr 4 x")
    assert result.stdout == b"x2\n"


def test_signal_death_reports_the_signal(stub: Stub) -> None:
    result = run(stub, shell="kill -TERM $$")
    assert result.status.WhichOneof("termination") == "signal"
    assert result.status.signal == signal.SIGTERM
    assert not result.status.timed_out


def test_env_is_merged_with_the_base_environment(stub: Stub) -> None:
    result = run(
        stub, shell='printf "%s|%s" "$ORCHARD_TEST_VAR" "$PATH"', env={"ORCHARD_TEST_VAR": "v"}
    )
    value, path = result.stdout.decode().split("|")
    assert value == "v"
    assert "/bin" in path


def test_clear_env_starts_from_nothing(stub: Stub) -> None:
    result = run(stub, argv=["/usr/bin/env"], clear_env=True, env={"ONLY": "1"})
    assert result.stdout == b"ONLY=1\n"


def test_agent_configuration_variables_are_not_inherited(stub: Stub) -> None:
    result = run(stub, argv=["env"])
    assert b"ORCHARD_" not in result.stdout


def test_working_dir_absolute_and_relative(stub: Stub, agent: Any, tmp_path: Path) -> None:
    assert run(stub, argv=["pwd"], working_dir=str(tmp_path)).stdout == f"{tmp_path}\n".encode()
    assert run(stub, argv=["pwd"]).stdout == f"{agent.working_dir}\n".encode()
    (agent.working_dir / "sub").mkdir(exist_ok=True)
    try:
        assert run(stub, argv=["pwd"], working_dir="sub").stdout == (
            f"{agent.working_dir / 'sub'}\n".encode()
        )
    finally:
        (agent.working_dir / "sub").rmdir()


def test_relative_executable_resolves_against_working_dir(stub: Stub, tmp_path: Path) -> None:
    script = tmp_path / "hello.sh"
    script.write_text("#!/bin/sh\necho hello from script\n")
    script.chmod(0o755)
    result = run(stub, argv=["./hello.sh"], working_dir=str(tmp_path))
    assert result.stdout == b"hello from script\n"


def test_stdin_bytes_are_fed_then_closed(stub: Stub) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)  # larger than a pipe: written as the command reads
    result = run(stub, argv=["cat"], stdin=data, output_limit_bytes=4 * 1024 * 1024)
    assert result.stdout == data
    assert run(stub, argv=["cat"]).stdout == b""  # no stdin: end of file at once


def test_stdin_not_read_by_the_command_is_fine(stub: Stub) -> None:
    result = run(stub, argv=["true"], stdin=os.urandom(1024 * 1024))
    assert result.status.exit_code == 0


def test_binary_output_is_byte_exact(stub: Stub, tmp_path: Path) -> None:
    data = bytes(range(256)) * 64 + os.urandom(100_000)
    source = tmp_path / "blob"
    source.write_bytes(data)
    result = run(stub, shell=f"cat {source}; cat {source} >&2")
    assert result.stdout == data
    assert result.stderr == data


def test_output_cap_truncates_and_counts(stub: Stub) -> None:
    result = run(stub, shell="head -c 100000 /dev/zero; printf abc >&2", output_limit_bytes=1000)
    assert result.stdout == b"\0" * 1000
    assert result.status.stdout_truncated
    assert result.status.stdout_bytes == 100_000
    assert result.stderr == b"abc"
    assert not result.status.stderr_truncated


# --- timeouts and process groups


def test_timeout_kills_the_whole_process_group(stub: Stub, procs: Any) -> None:
    started = time.monotonic()
    result = run(stub, timeout_s=0.5, shell="sleep 100 & echo $!; sleep 100")
    assert time.monotonic() - started < 5
    assert result.status.timed_out
    assert result.status.signal == signal.SIGKILL
    background = int(result.stdout)
    assert procs.wait_until(lambda: not procs.is_alive(background), 5)


def test_timeout_kills_a_daemonized_grandchild_in_the_group(stub: Stub, procs: Any) -> None:
    # The grandchild's parent exits at once, so it is reparented, but stays in the group.
    result = run(
        stub,
        timeout_s=0.5,
        shell="(sleep 100 >/dev/null 2>&1 & echo $! > /dev/stdout) ; sleep 100",
    )
    assert result.status.timed_out
    grandchild = int(result.stdout)
    assert procs.wait_until(lambda: not procs.is_alive(grandchild), 5)


def test_background_process_holding_the_pipe_does_not_block_the_result(
    stub: Stub, procs: Any
) -> None:
    started = time.monotonic()
    result = run(stub, shell="sleep 30 & echo $!")
    assert time.monotonic() - started < 3
    assert result.status.exit_code == 0
    background = int(result.stdout)
    try:
        assert procs.is_alive(background)  # left running on purpose, like a server
    finally:
        os.kill(background, signal.SIGKILL)


@pytest.mark.slow
def test_huge_output_is_dropped_without_growing_memory(stub: Stub, agent: Any, procs: Any) -> None:
    result = run(stub, shell="head -c 2G /dev/zero; echo done >&2", output_limit_bytes=65536)
    assert result.status.exit_code == 0
    assert result.status.stdout_bytes == 2 * 1024**3
    assert result.status.stdout_truncated
    assert len(result.stdout) == 65536
    assert result.stderr == b"done\n"
    peak = procs.memory_kib(agent.pid, "VmHWM")
    assert peak < 200 * 1024, f"agent peak RSS {peak} KiB"


# --- streaming


def test_stream_events_in_order(stub: Stub) -> None:
    command = exec_pb2.Command(
        shell="printf a; sleep 0.1; printf b >&2; sleep 0.1; printf c; exit 3"
    )
    events = [r.event for r in stub.ExecStream(pb.ExecStreamRequest(command=command), timeout=30)]
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["started", "stdout", "stderr", "stdout", "exit"]
    assert events[0].started.pid > 0
    assert [events[1].stdout, events[2].stderr, events[3].stdout] == [b"a", b"b", b"c"]
    assert events[4].exit.exit_code == 3
    assert (events[4].exit.stdout_bytes, events[4].exit.stderr_bytes) == (2, 1)


def test_stream_delivers_chunks_as_written(stub: Stub) -> None:
    command = exec_pb2.Command(shell="echo first; sleep 1; echo second")
    stream = stub.ExecStream(pb.ExecStreamRequest(command=command), timeout=30)
    assert next(stream).event.HasField("started")
    started = time.monotonic()
    assert next(stream).event.stdout == b"first\n"
    assert time.monotonic() - started < 0.8  # not held back until the command ends
    rest = [r.event for r in stream]
    assert rest[0].stdout == b"second\n"
    assert rest[-1].HasField("exit")


def test_stream_output_cap(stub: Stub) -> None:
    command = exec_pb2.Command(shell="head -c 300000 /dev/zero", output_limit_bytes=1000)
    events = [r.event for r in stub.ExecStream(pb.ExecStreamRequest(command=command), timeout=30)]
    assert sum(len(e.stdout) for e in events) == 1000
    assert events[-1].exit.stdout_truncated
    assert events[-1].exit.stdout_bytes == 300_000


def test_cancelled_stream_kills_the_process_group(stub: Stub, procs: Any) -> None:
    command = exec_pb2.Command(shell="sleep 1000 & echo $!; sleep 1000")
    stream = stub.ExecStream(pb.ExecStreamRequest(command=command), timeout=30)
    pid = next(stream).event.started.pid
    background = int(next(stream).event.stdout)
    assert os.getpgid(pid) == pid  # its own process group
    assert procs.is_alive(pid) and procs.is_alive(background)
    stream.cancel()
    assert procs.wait_until(lambda: not procs.is_alive(pid) and not procs.is_alive(background))
    assert procs.group_members(pid) == []


def test_cancelled_exec_kills_the_process_group(stub: Stub, procs: Any, tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    request = pb.ExecRequest(command=exec_pb2.Command(shell=f"echo $$ > {marker}; sleep 1000"))
    future = stub.Exec.future(request, timeout=30)
    assert procs.wait_until(lambda: marker.exists() and marker.read_text().strip() != "")
    pid = int(marker.read_text())
    future.cancel()
    assert procs.wait_until(lambda: not procs.is_alive(pid))


def test_client_deadline_kills_the_command(stub: Stub, procs: Any, tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    request = pb.ExecRequest(command=exec_pb2.Command(shell=f"echo $$ > {marker}; exec sleep 1000"))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Exec(request, timeout=0.5)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    pid = int(marker.read_text())
    assert procs.wait_until(lambda: not procs.is_alive(pid))


def test_commands_run_concurrently(stub: Stub) -> None:
    results: list[exec_pb2.ExecResult] = []

    def one() -> None:
        results.append(run(stub, argv=["sleep", "0.5"]))

    threads = [threading.Thread(target=one) for _ in range(8)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert time.monotonic() - started < 3
    assert [r.status.exit_code for r in results] == [0] * 8


# --- bad input: each a clear status, and the agent keeps serving


def expect_error(stub: Stub, code: grpc.StatusCode, words: str, **command: Any) -> Any:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Exec(pb.ExecRequest(command=exec_pb2.Command(**command)), timeout=10)
    error = caught.value
    assert error.code() == code, error.details()
    assert words in error.details()
    # and the stream form refuses the same way, before any event
    with pytest.raises(grpc.RpcError) as streamed:
        list(stub.ExecStream(pb.ExecStreamRequest(command=exec_pb2.Command(**command)), timeout=10))
    assert streamed.value.code() == code
    assert stub.GetAgentInfo(pb.GetAgentInfoRequest(), timeout=5).version
    return error_info(error)


def test_missing_executable_is_not_found_naming_it(stub: Stub) -> None:
    info = expect_error(
        stub, grpc.StatusCode.NOT_FOUND, "'no-such-program-x'", argv=["no-such-program-x"]
    )
    assert info.reason == "EXECUTABLE_NOT_FOUND"
    expect_error(stub, grpc.StatusCode.NOT_FOUND, "'/no/such/bin'", argv=["/no/such/bin"])


def test_missing_interpreter_is_not_found(stub: Stub, tmp_path: Path) -> None:
    script = tmp_path / "script"
    script.write_text("#!/no/such/interpreter\n")
    script.chmod(0o755)
    expect_error(stub, grpc.StatusCode.NOT_FOUND, "interpreter", argv=[str(script)])


def test_not_executable_is_permission_denied(stub: Stub, tmp_path: Path) -> None:
    target = tmp_path / "data.txt"
    target.write_text("not a program")
    target.chmod(0o644)
    info = expect_error(
        stub, grpc.StatusCode.PERMISSION_DENIED, "not executable", argv=[str(target)]
    )
    assert info.reason == "NOT_EXECUTABLE"
    expect_error(stub, grpc.StatusCode.PERMISSION_DENIED, "a directory", argv=[str(tmp_path)])


def test_missing_working_dir_is_not_found(stub: Stub, tmp_path: Path) -> None:
    info = expect_error(
        stub,
        grpc.StatusCode.NOT_FOUND,
        "working directory",
        argv=["true"],
        working_dir=str(tmp_path / "gone"),
    )
    assert info.reason == "WORKING_DIR_NOT_FOUND"


def test_working_dir_that_is_a_file_is_invalid(stub: Stub, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    expect_error(
        stub,
        grpc.StatusCode.INVALID_ARGUMENT,
        "not a directory",
        argv=["true"],
        working_dir=str(tmp_path / "f"),
    )


@pytest.mark.parametrize(
    ("timeout", "words"),
    [
        (duration_pb2.Duration(seconds=0), "timeout must be positive"),
        (duration_pb2.Duration(seconds=-5), "timeout must be positive"),
        (duration_pb2.Duration(nanos=-1), "timeout must be positive"),
        (duration_pb2.Duration(seconds=1, nanos=2_000_000_000), "nanos"),
    ],
)
def test_bad_timeout_is_invalid(stub: Stub, timeout: duration_pb2.Duration, words: str) -> None:
    expect_error(stub, grpc.StatusCode.INVALID_ARGUMENT, words, argv=["true"], timeout=timeout)


def test_argv_and_shell_both_or_neither_are_invalid(stub: Stub) -> None:
    expect_error(stub, grpc.StatusCode.INVALID_ARGUMENT, "not both", argv=["true"], shell="true")
    expect_error(stub, grpc.StatusCode.INVALID_ARGUMENT, "set one of argv")


@pytest.mark.parametrize("name", ["A=B", "", "A\0B"])
def test_bad_env_names_are_invalid(stub: Stub, name: str) -> None:
    expect_error(
        stub,
        grpc.StatusCode.INVALID_ARGUMENT,
        "environment variable name",
        argv=["true"],
        env={name: "x"},
    )


def test_nul_in_env_value_is_invalid(stub: Stub) -> None:
    expect_error(stub, grpc.StatusCode.INVALID_ARGUMENT, "NUL", argv=["true"], env={"A": "x\0y"})


def test_nul_in_argv_or_shell_is_invalid(stub: Stub) -> None:
    expect_error(
        stub, grpc.StatusCode.INVALID_ARGUMENT, "argv[1] contains a NUL", argv=["echo", "a\0b"]
    )
    expect_error(stub, grpc.StatusCode.INVALID_ARGUMENT, "shell contains a NUL", shell="echo \0")


def test_empty_argv0_is_invalid(stub: Stub) -> None:
    expect_error(stub, grpc.StatusCode.INVALID_ARGUMENT, "argv[0] is empty", argv=["", "x"])


def test_output_cap_out_of_range_is_invalid(stub: Stub) -> None:
    expect_error(
        stub,
        grpc.StatusCode.INVALID_ARGUMENT,
        "output_limit_bytes",
        argv=["true"],
        output_limit_bytes=-1,
    )
    expect_error(
        stub,
        grpc.StatusCode.INVALID_ARGUMENT,
        "output_limit_bytes must be from 0 to",
        argv=["true"],
        output_limit_bytes=1 << 40,
    )


def test_agent_info(stub: Stub, agent: Any) -> None:
    info = stub.GetAgentInfo(pb.GetAgentInfoRequest(), timeout=5)
    assert info.version == "0.1.0"
    assert info.pid == agent.pid
    assert info.working_dir == str(agent.working_dir)
    assert info.default_timeout.seconds == 600
    assert 0 < info.default_output_limit_bytes <= info.max_output_limit_bytes
    assert info.uptime.ToTimedelta().total_seconds() > 0
