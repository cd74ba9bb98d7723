"""Faulty and hostile requests through the real service: file streams that break the protocol or
stop half way, paths and labels sized to overflow a status, paths the agent cannot read."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.core.errors import error_info
from orchard.env.v1 import env_service_pb2 as api

pytestmark = [pytest.mark.root]

CHUNK = 64 * 1024


def agent_pid(env: Any, sandbox_id: str) -> int:
    """The agent's host pid (the unisolated runtime runs it as a plain process)."""
    pid = env.app._runtime._pid(sandbox_id)
    assert pid, sandbox_id
    return int(pid)


def deleted_files(pid: int) -> list[str]:
    """Descriptors of ``pid`` open on files that were removed (disk held until they close)."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.endswith("(deleted)"):
            found.append(target)
    return found


async def until(check: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(0.02)
    return bool(check())


async def test_a_second_header_in_a_write_stream_fails_at_once(env: Any, tmp_path: Any) -> None:
    sandbox = await env.ready(image="host")
    tmp_path = tmp_path / "files"
    tmp_path.mkdir()
    header = api.WriteFileRequest(
        header=api.WriteFileHeader(sandbox_id=sandbox.id, path=str(tmp_path / "twice"))
    )
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        # No deadline of the caller's: the old code waited for the agent's 3,600 s default.
        await asyncio.wait_for(
            env.stub.WriteFile(iter([header, header]), metadata=env.md()), timeout=20
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert "only the first" in (caught.value.details() or "")
    assert time.monotonic() - started < 5
    assert not (tmp_path / "twice").exists()
    # The agent's call was cancelled: its temporary goes with it (a moment later).
    assert await until(lambda: list(tmp_path.iterdir()) == []), list(tmp_path.iterdir())


async def test_an_aborted_upload_closes_and_removes_the_temporary(env: Any, tmp_path: Any) -> None:
    sandbox = await env.ready(image="host")
    pid = agent_pid(env, sandbox.id)
    tmp_path = tmp_path / "files"
    tmp_path.mkdir()
    target = tmp_path / "upload.bin"
    stalled = asyncio.Event()

    async def upload() -> AsyncIterator[api.WriteFileRequest]:
        yield api.WriteFileRequest(
            header=api.WriteFileHeader(sandbox_id=sandbox.id, path=str(target))
        )
        for _ in range(16):
            yield api.WriteFileRequest(data=os.urandom(CHUNK))
        stalled.set()
        await asyncio.sleep(3600)  # the client goes quiet, then gives up

    call = env.stub.WriteFile(upload(), metadata=env.md())
    await asyncio.wait_for(stalled.wait(), 20)
    assert await until(lambda: len(list(tmp_path.iterdir())) == 1)  # the temporary
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await until(lambda: list(tmp_path.iterdir()) == [] and not deleted_files(pid)), (
        list(tmp_path.iterdir()),
        deleted_files(pid),
    )
    # The sandbox still takes writes: nothing of the aborted call holds it.
    reply = await env.stub.WriteFile(
        iter(
            [
                api.WriteFileRequest(
                    header=api.WriteFileHeader(sandbox_id=sandbox.id, path=str(target))
                ),
                api.WriteFileRequest(data=b"whole"),
            ]
        ),
        metadata=env.md(),
        timeout=20,
    )
    assert reply.info.size == 5
    assert target.read_bytes() == b"whole"


async def test_a_path_1500_directories_deep_is_made_or_refused_cleanly(
    env: Any, tmp_path: Any
) -> None:
    sandbox = await env.ready(image="host")
    base = tmp_path / "deep"
    path = f"{base}/" + "d/" * 1500 + "leaf"
    assert len(path.encode()) < 4096  # within PATH_MAX: only the depth is extreme
    try:
        await _write_and_read_deep(env, sandbox.id, path)
    finally:
        _remove_deep(base, path)


async def _write_and_read_deep(env: Any, sandbox_id: str, path: str) -> None:
    reply = await env.stub.WriteFile(
        iter(
            [
                api.WriteFileRequest(
                    header=api.WriteFileHeader(sandbox_id=sandbox_id, path=path, make_parents=True)
                ),
                api.WriteFileRequest(data=b"deep"),
            ]
        ),
        metadata=env.md(),
        timeout=30,
    )
    assert reply.info.size == 4
    read = env.stub.ReadFile(
        api.ReadFileRequest(sandbox_id=sandbox_id, path=path), metadata=env.md(), timeout=30
    )
    assert b"".join([r.data async for r in read]) == b"deep"


def _remove_deep(base: Path, path: str) -> None:
    """Remove the tree bottom-up without recursion (shutil.rmtree recurses per level)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    directory = os.path.dirname(path)
    while len(directory) >= len(str(base)):
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(directory)
        directory = os.path.dirname(directory)


async def test_reading_process_memory_is_a_clear_refusal_not_internal(env: Any) -> None:
    sandbox = await env.ready(image="host")
    for path in ("/proc/1/mem", "/proc/self/mem"):
        read = env.stub.ReadFile(
            api.ReadFileRequest(sandbox_id=sandbox.id, path=path), metadata=env.md(), timeout=30
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            _ = [r async for r in read]
        assert caught.value.code() in (
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.INVALID_ARGUMENT,
        ), (path, caught.value)
        info = error_info(caught.value)
        assert info is not None and info.metadata.get("errno") in ("EIO", "EPERM", "EACCES")


async def test_huge_label_keys_and_paths_get_invalid_argument_not_an_overflow(
    env: Any,
) -> None:
    key = "K" * 100_000
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.create(labels={key: "v"})
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.code()
    assert len(caught.value.details() or "") < 2000
    info = error_info(caught.value)
    assert info is not None and all(len(v) < 300 for v in info.metadata.values())

    sandbox = await env.ready(image="host")
    long_path = "/" + "p" * 65_536
    calls = {
        "read": lambda: _drain(
            env.stub.ReadFile(
                api.ReadFileRequest(sandbox_id=sandbox.id, path=long_path),
                metadata=env.md(),
                timeout=30,
            )
        ),
        "stat": lambda: env.stub.StatFile(
            api.StatFileRequest(sandbox_id=sandbox.id, path=long_path),
            metadata=env.md(),
            timeout=30,
        ),
        "list": lambda: env.stub.ListFiles(
            api.ListFilesRequest(sandbox_id=sandbox.id, path=long_path),
            metadata=env.md(),
            timeout=30,
        ),
        "write": lambda: env.stub.WriteFile(
            iter(
                [
                    api.WriteFileRequest(
                        header=api.WriteFileHeader(sandbox_id=sandbox.id, path=long_path)
                    )
                ]
            ),
            metadata=env.md(),
            timeout=30,
        ),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, caught.value)
        assert len(caught.value.details() or "") < 2000, name


async def _drain(call: Any) -> list[Any]:
    return [reply async for reply in call]


async def test_owner_and_fork_labels_with_a_huge_key_are_invalid(env: Any) -> None:
    sandbox = await env.ready(image="host")
    key = "x" * 100_000
    owner = api.CreateOwnerRequest()
    owner.labels[key] = "v"
    fork = api.ForkSandboxRequest(sandbox_id=sandbox.id, count=1)
    fork.labels[key] = "v"
    for name, call in (
        ("owner", lambda: env.stub.CreateOwner(owner, metadata=env.md(), timeout=30)),
        ("fork", lambda: env.stub.ForkSandbox(fork, metadata=env.md(), timeout=30)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, caught.value)
