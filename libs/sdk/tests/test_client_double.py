"""The client against the fault-injecting test double (see conftest): retries, error mapping,
heartbeats, paging, and exec/files through a real agent."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.sdk import (
    AsyncSandboxClient,
    CommandFailed,
    DeadlineExceeded,
    ExecExit,
    ExecStarted,
    ExecStdout,
    FileNotFound,
    Internal,
    InvalidArgument,
    PatchFailed,
    PermissionDenied,
    ResourceExhausted,
    Resources,
    RetryPolicy,
    SandboxClient,
    SandboxFailed,
    SandboxNotFound,
    SandboxNotReady,
    SandboxState,
    Unauthenticated,
    Unavailable,
)

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.02)


@pytest.fixture
def client(double: Any, isolated_env: Path) -> Any:
    with SandboxClient(double.address, token=double.token, retry=FAST_RETRY, timeout=10) as client:
        yield client


# -- lifecycle ---------------------------------------------------------------------------------


def test_create_waits_and_with_deletes(client: SandboxClient, double: Any) -> None:
    with client.create(
        image="host",
        labels={"task": "t1"},
        resources=Resources.of(cpus=1.5, memory="512M"),
        heartbeat_timeout=60,
        env={"A": "1"},
    ) as sandbox:
        assert sandbox.state is SandboxState.READY
        assert sandbox.info.labels == {"task": "t1"}
        assert sandbox.info.resources.cpu_millis == 1500
        assert sandbox.info.resources.memory_bytes == 512 * 2**20
        assert sandbox.info.heartbeat_timeout == 60
        assert sandbox.id in double.servicer.sandboxes
    assert sandbox.id not in double.servicer.sandboxes
    assert double.servicer.methods() == ["CreateSandbox", "WaitSandbox", "DeleteSandbox"]


def test_create_retries_unavailable_with_one_request_id(client: SandboxClient, double: Any) -> None:
    double.fail("CreateSandbox", grpc.StatusCode.UNAVAILABLE, times=2)
    sandbox = client.create(wait=False, keep_alive=False)
    creates = double.servicer.requests("CreateSandbox")
    assert len(creates) == 3
    assert len({request.request_id for request in creates}) == 1
    assert creates[0].request_id
    assert len(double.servicer.sandboxes) == 1
    assert sandbox.state is SandboxState.PENDING


def test_retries_give_up_after_max_attempts(client: SandboxClient, double: Any) -> None:
    created = client.create(keep_alive=False)
    double.fail(
        "GetSandbox",
        grpc.StatusCode.UNAVAILABLE,
        "store down",
        reason="STATE_STORE_UNAVAILABLE",
        times=10,
    )
    with pytest.raises(Unavailable) as caught:
        client.get_info(created.id)
    assert caught.value.reason == "STATE_STORE_UNAVAILABLE"
    assert "store down" in str(caught.value)
    assert double.servicer.methods().count("GetSandbox") == FAST_RETRY.max_attempts


def test_exec_is_not_retried(client: SandboxClient, double: Any) -> None:
    sandbox = client.create(keep_alive=False)
    double.fail("Exec", grpc.StatusCode.UNAVAILABLE, "agent gone", reason="AGENT_UNAVAILABLE")
    with pytest.raises(Unavailable):
        sandbox.exec(["true"])
    assert double.servicer.methods().count("Exec") == 1


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ((grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"), InvalidArgument),
        ((grpc.StatusCode.PERMISSION_DENIED, None), PermissionDenied),
        ((grpc.StatusCode.DEADLINE_EXCEEDED, None), DeadlineExceeded),
        ((grpc.StatusCode.NOT_FOUND, "SANDBOX_NOT_FOUND"), SandboxNotFound),
        ((grpc.StatusCode.INTERNAL, "INTERNAL"), Internal),
    ],
)
def test_errors_are_typed(
    client: SandboxClient, double: Any, fault: tuple[grpc.StatusCode, str | None], expected: type
) -> None:
    code, reason = fault
    double.fail("CreateSandbox", code, "it went wrong", reason=reason)
    with pytest.raises(expected) as caught:
        client.create()
    assert caught.value.code == code
    assert caught.value.reason == (reason or code.name)
    assert caught.value.message == "it went wrong"
    assert double.servicer.methods() == ["CreateSandbox"]


def test_resource_exhausted_carries_retry_hint(client: SandboxClient, double: Any) -> None:
    double.fail(
        "CreateSandbox",
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "queue full",
        reason="RESOURCE_EXHAUSTED",
        retry_delay_s=2.5,
    )
    with pytest.raises(ResourceExhausted) as caught:
        client.create()
    assert caught.value.retry_after == 2.5
    assert double.servicer.methods() == ["CreateSandbox"]  # never retried on its own


def test_resource_exhausted_hint_from_metadata(client: SandboxClient, double: Any) -> None:
    double.fail(
        "CreateSandbox",
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "quota",
        reason="RESOURCE_EXHAUSTED",
        metadata={"retry_after_s": "7"},
    )
    with pytest.raises(ResourceExhausted) as caught:
        client.create()
    assert caught.value.retry_after == 7.0


def test_unknown_sandbox_and_not_ready(client: SandboxClient) -> None:
    with pytest.raises(SandboxNotFound):
        client.get("sbx-nope")
    pending = client.create(wait=False, keep_alive=False)
    with pytest.raises(SandboxNotReady):
        pending.exec(["true"])


def test_wrong_token_is_unauthenticated(double: Any, isolated_env: Path) -> None:
    with SandboxClient(double.address, token="wrong") as client, pytest.raises(Unauthenticated):
        client.create()


def test_failed_sandbox_raises_and_is_deleted(client: SandboxClient, double: Any) -> None:
    with pytest.raises(SandboxFailed) as caught:
        client.create(image="fail:missing")
    assert caught.value.failure_reason == "IMAGE_NOT_FOUND"
    assert double.servicer.sandboxes == {}
    assert double.servicer.methods()[-1] == "DeleteSandbox"


def test_wait_deadline_deletes_the_sandbox(client: SandboxClient, double: Any) -> None:
    with pytest.raises(DeadlineExceeded):
        client.create(image="slow:image", wait_timeout=1)
    assert double.servicer.sandboxes == {}


def test_unreachable_endpoint_says_where(isolated_env: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with SandboxClient(f"127.0.0.1:{port}", retry=FAST_RETRY, timeout=5) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable) as caught:
            list(client.list())
    assert f"cannot reach the environment service at 127.0.0.1:{port}" in str(caught.value)
    assert time.monotonic() - started < 5


def test_list_pages(client: SandboxClient, double: Any) -> None:
    ids = {client.create(labels={"job": "a"}, keep_alive=False).id for _ in range(5)}
    client.create(labels={"job": "b"}, keep_alive=False)
    listed = list(client.list({"job": "a"}, page_size=2))
    assert {info.id for info in listed} == ids
    pages = double.servicer.requests("ListSandboxes")
    assert [request.page_token != "" for request in pages] == [False, True, True]
    assert all(request.label_selector == "job=a" for request in pages)
    double.fail("ListSandboxes", grpc.StatusCode.UNAVAILABLE)
    assert len(list(client.list("job=b"))) == 1


def test_heartbeats_run_at_a_third_of_the_timeout(client: SandboxClient, double: Any) -> None:
    sandbox = client.create(heartbeat_timeout=0.9)
    time.sleep(1.1)
    beats = double.servicer.heartbeats[sandbox.id]
    assert 2 <= beats <= 4
    sandbox.close()
    time.sleep(0.5)
    assert double.servicer.heartbeats[sandbox.id] == beats
    assert sandbox.id in double.servicer.sandboxes  # close() does not delete


def test_heartbeats_stop_when_the_sandbox_is_gone(client: SandboxClient, double: Any) -> None:
    sandbox = client.create(heartbeat_timeout=0.6)
    del double.servicer.sandboxes[sandbox.id]
    time.sleep(0.5)
    assert isinstance(sandbox.heartbeat_error, SandboxNotFound)


# -- exec and files through a real agent ----------------------------------------------------------


def test_exec_argv_shell_and_check(client: SandboxClient, tmp_path: Path) -> None:
    sandbox = client.create(keep_alive=False)
    result = sandbox.exec(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=10)
    assert (result.exit_code, result.stdout, result.stderr) == (3, b"out\n", b"err\n")
    assert not result.ok
    assert result.duration > 0
    with pytest.raises(CommandFailed, match="exited with status 3: err"):
        result.check()
    shell = sandbox.exec(
        "cat; echo $GREETING; pwd", stdin="in\n", env={"GREETING": "hi"}, cwd=str(tmp_path)
    )
    assert shell.check().stdout_text == f"in\nhi\n{tmp_path}\n"
    slow = sandbox.exec(["sleep", "5"], timeout=0.3)
    assert slow.timed_out and slow.signal == 9 and slow.exit_code is None
    with pytest.raises(FileNotFound):
        sandbox.exec(["/no/such/program"])


def test_exec_stream_events(client: SandboxClient) -> None:
    sandbox = client.create(keep_alive=False)
    events = list(sandbox.exec_stream("echo one; sleep 0.1; echo two; exit 4"))
    assert isinstance(events[0], ExecStarted) and events[0].pid > 0
    assert isinstance(events[-1], ExecExit) and events[-1].exit_code == 4
    output = b"".join(e.data for e in events if isinstance(e, ExecStdout))
    assert output == b"one\ntwo\n"


def test_exec_stream_break_kills_the_command(client: SandboxClient, tmp_path: Path) -> None:
    sandbox = client.create(keep_alive=False)
    marker = tmp_path / "survived"
    stream = sandbox.exec_stream(f"echo started; sleep 1; touch {marker}")
    for event in stream:
        if isinstance(event, ExecStdout):
            break
    stream.close()  # type: ignore[attr-defined]
    time.sleep(1.5)
    assert not marker.exists()


def test_write_read_and_resume(client: SandboxClient, double: Any, tmp_path: Path) -> None:
    sandbox = client.create(keep_alive=False)
    path = str(tmp_path / "deep" / "file.bin")
    content = os.urandom(3 * 4096 + 17)
    info = sandbox.write_file(path, content, mode=0o600)
    assert info.size == len(content) and info.mode == 0o600
    # The stream breaks after two chunks; the client resumes from the offset it had.
    double.fail("ReadFile", grpc.StatusCode.UNAVAILABLE, "blip", after_messages=2)
    assert sandbox.read_file(path) == content
    offsets = [request.offset for request in double.servicer.requests("ReadFile")]
    assert offsets == [0, 2 * 4096]
    assert sandbox.read_file(path, offset=10, limit=5) == content[10:15]
    with pytest.raises(FileNotFound):
        sandbox.read_file(str(tmp_path / "missing"))


def test_upload_download_tree(client: SandboxClient, tmp_path: Path) -> None:
    sandbox = client.create(keep_alive=False)
    source = tmp_path / "src"
    (source / "pkg" / "empty").mkdir(parents=True)
    (source / "pkg" / "mod.py").write_text("x = 1\n")
    (source / "run.sh").write_text("#!/bin/sh\necho run\n")
    (source / "run.sh").chmod(0o755)
    (source / "big.bin").write_bytes(os.urandom(3 << 20))
    (source / "link").symlink_to("pkg/mod.py")
    seen: list[tuple[int, int]] = []
    remote = str(tmp_path / "remote" / "copy")
    written = sandbox.upload(
        source, remote, progress=lambda done, total: seen.append((done, total))
    )
    total = (3 << 20) + len("x = 1\n") + len("#!/bin/sh\necho run\n")
    assert written == total
    assert seen[0] == (0, total) and seen[-1] == (total, total)
    assert sandbox.exec([f"{remote}/run.sh"]).check().stdout == b"run\n"
    assert sandbox.stat(f"{remote}/pkg/empty").is_dir
    back = tmp_path / "back"
    assert sandbox.download(remote, back) == total
    assert (back / "big.bin").read_bytes() == (source / "big.bin").read_bytes()
    assert (back / "pkg" / "mod.py").read_text() == "x = 1\n"
    assert stat.S_IMODE((back / "run.sh").stat().st_mode) == 0o755
    assert os.readlink(back / "link") == "pkg/mod.py"
    assert (back / "pkg" / "empty").is_dir()
    single = tmp_path / "single.txt"
    assert sandbox.download(f"{remote}/pkg/mod.py", single) == 6
    assert single.read_text() == "x = 1\n"


DIFF = """\
--- a/hello.txt
+++ b/hello.txt
@@ -1,2 +1,2 @@
 hello
-world
+orchard
"""


def test_apply_diff(client: SandboxClient, tmp_path: Path) -> None:
    sandbox = client.create(keep_alive=False)
    (tmp_path / "hello.txt").write_text("hello\nworld\n")
    sandbox.apply_diff(DIFF, cwd=str(tmp_path))
    assert (tmp_path / "hello.txt").read_text() == "hello\norchard\n"
    with pytest.raises(PatchFailed) as caught:
        sandbox.apply_diff(DIFF, cwd=str(tmp_path))  # already applied: no longer matches
    assert caught.value.tool == "git apply"
    assert "patch does not apply" in caught.value.output
    assert (tmp_path / "hello.txt").read_text() == "hello\norchard\n"
    assert not [
        p for p in Path("/tmp").glob("orchard-*.diff") if p.stat().st_mtime > time.time() - 5
    ]


def test_apply_diff_without_git_uses_patch(client: SandboxClient, tmp_path: Path) -> None:
    sandbox = client.create(keep_alive=False)
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("patch", "rm"):
        (tools / name).symlink_to(f"/usr/bin/{name}")
    (tmp_path / "hello.txt").write_text("hello\nworld\n")
    handle = sandbox._handle
    original_exec = handle.exec

    async def exec_with_path(command: Any, **options: Any) -> Any:
        options["env"] = {"PATH": str(tools)}
        return await original_exec(command, **options)

    handle.exec = exec_with_path  # type: ignore[method-assign]
    sandbox.apply_diff(DIFF, cwd=str(tmp_path))
    assert (tmp_path / "hello.txt").read_text() == "hello\norchard\n"
    with pytest.raises(PatchFailed) as caught:
        sandbox.apply_diff(DIFF.replace("world", "planet"), cwd=str(tmp_path))
    assert caught.value.tool == "patch"
    assert not list(tmp_path.glob("*.rej")) and not list(tmp_path.glob("*.orig"))
    (tools / "patch").unlink()
    with pytest.raises(PatchFailed, match="neither `git` nor `patch`"):
        sandbox.apply_diff(DIFF, cwd=str(tmp_path))


# -- async ------------------------------------------------------------------------------------


async def test_async_client(double: Any, isolated_env: Path) -> None:
    async with AsyncSandboxClient(double.address, token=double.token, retry=FAST_RETRY) as client:
        async with client.create(image="host", labels={"a": "b"}) as sandbox:
            result = await sandbox.exec(["echo", "async"])
            assert result.check().stdout_text == "async\n"
            listed = [info.id async for info in client.list("a=b")]
            assert listed == [sandbox.id]
        assert sandbox.id not in double.servicer.sandboxes
        kept = await client.create(keep_alive=False)
        events = [event async for event in kept.exec_stream(["echo", "x"])]
        assert events[-1] == ExecExit(exit_code=0, duration=events[-1].duration, stdout_bytes=2)
        await kept.delete()
