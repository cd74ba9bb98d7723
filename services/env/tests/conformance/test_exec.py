"""Exec semantics through the agent inside the sandbox, and the file round trip."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import pytest

from orchard.inagent.v1 import inagent_service_pb2 as agent_pb

pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture
async def agent(sandboxes: Any, agent_for: Any) -> Any:
    return agent_for(await sandboxes.create())


async def test_exit_codes_and_stdin(agent: Any) -> None:
    assert (await agent.sh("exit 3")).status.exit_code == 3
    result = await agent.sh("tr a-z A-Z", stdin=b"shout\n")
    assert result.stdout == b"SHOUT\n"
    result = await agent.sh("echo oops >&2; kill -TERM $$")
    assert result.status.signal == 15 and result.stderr == b"oops\n"


async def test_timeout_kills_grandchildren(agent: Any) -> None:
    started = time.monotonic()
    result = await agent.sh("sh -c 'sleep 300 & sleep 300' & sleep 300", timeout_s=0.5)
    assert result.status.timed_out
    assert time.monotonic() - started < 10
    left = await agent.sh("ps -o comm | grep -c '^sleep' || true")
    assert left.stdout.strip() == b"0"


async def test_large_binary_output(agent: Any) -> None:
    size = 6 * 1024 * 1024
    result = await agent.sh(
        f"head -c {size} /dev/urandom >/tmp/blob; md5sum </tmp/blob >&2; cat /tmp/blob", limit=size
    )
    assert len(result.stdout) == size
    assert hashlib.md5(result.stdout).hexdigest().encode() in result.stderr


async def test_files_round_trip(agent: Any) -> None:
    data = os.urandom(300_000) + b"\0\xff"

    async def requests() -> Any:
        header = agent_pb.WriteFileHeader(path="/data/in.bin", mode=0o600, make_parents=True)
        yield agent_pb.WriteFileRequest(header=header)
        for offset in range(0, len(data), 65536):
            yield agent_pb.WriteFileRequest(data=data[offset : offset + 65536])

    metadata = await agent.metadata()
    written = await agent.stub.WriteFile(requests(), timeout=30, metadata=metadata)
    assert written.sha256 == hashlib.sha256(data).hexdigest()
    chunks = [
        reply.data
        async for reply in agent.stub.ReadFile(
            agent_pb.ReadFileRequest(path="/data/in.bin"), metadata=metadata
        )
    ]
    assert b"".join(chunks) == data
    assert (await agent.sh("stat -c %a /data/in.bin")).stdout == b"600\n"
