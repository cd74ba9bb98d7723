"""What a sandbox cannot see or reach, and the limits it runs under."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from orchard.env.runtime.base import RuntimeResources, SandboxStatus

pytestmark = [pytest.mark.root, pytest.mark.slow]


async def test_no_network_but_loopback(sandboxes: Any, agent_for: Any) -> None:
    sandboxes.harness.require("network-isolation")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        agent = agent_for(await sandboxes.create())
        result = await agent.sh(f"nc -w 2 127.0.0.1 {port} </dev/null && echo connected")
        assert b"connected" not in result.stdout
        with pytest.raises(BlockingIOError):
            listener.accept()
        assert (await agent.sh("ls /sys/class/net")).stdout == b"lo\n"
        # Loopback itself works inside.
        both = await agent.sh(
            # Retry the client until the listener is up: a loaded machine starts it late. The
            # listener's stdin stays open (a listener whose stdin ends may quit before it reads
            # what came), and the output is awaited by content, not by the listener's exit.
            "sleep 20 2>/dev/null | nc -l -p 7777 > /tmp/got 2>/dev/null & "
            "for i in $(seq 100); do echo ping | nc -w 2 127.0.0.1 7777 && break; sleep 0.1; "
            "done; for i in $(seq 100); do grep -q ping /tmp/got && break; sleep 0.1; done; "
            "cat /tmp/got"
        )
        assert both.stdout.endswith(b"ping\n")
    finally:
        listener.close()


async def test_no_view_of_host_files(sandboxes: Any, agent_for: Any, tmp_path: Path) -> None:
    marker = tmp_path / "host-only"
    marker.write_text("secret")
    agent = agent_for(await sandboxes.create())
    result = await agent.sh(f"test -e {marker} && echo visible; ls /")
    assert b"visible" not in result.stdout


async def test_only_own_processes(sandboxes: Any, agent_for: Any) -> None:
    first = agent_for(await sandboxes.create())
    second = agent_for(await sandboxes.create())
    await second.sh("sleep 60 >/dev/null 2>&1 &")
    listing = (await first.sh("ps -o pid,comm")).stdout.decode().split("\n")[1:]
    pids = {int(line.split()[0]) for line in listing if line.strip()}
    assert 1 in pids and max(pids) < 100  # the agent is PID 1; nothing from the host
    assert "sleep" not in " ".join(listing)


async def test_hostname_is_the_id(sandboxes: Any, agent_for: Any) -> None:
    sandbox = await sandboxes.create()
    assert (await agent_for(sandbox).sh("hostname")).stdout.decode().strip() == sandbox.sandbox_id


async def test_memory_limit_kills_the_command_not_the_agent(sandboxes: Any, agent_for: Any) -> None:
    sandboxes.harness.require("memory-limit")
    # The agent itself needs about 40 MB; the command grows past the limit within a second.
    sandbox = await sandboxes.create(resources=RuntimeResources(memory_bytes=160 << 20))
    agent = agent_for(sandbox)
    result = await agent.sh(
        "awk 'BEGIN { s = \"xxxxxxxxxxxxxxxx\"; while (1) s = s s }'", timeout_s=30
    )
    assert result.status.signal == 9  # the OOM killer's SIGKILL, as the agent saw it
    assert (await agent.sh("echo alive")).stdout == b"alive\n"
    assert await sandboxes.runtime.status(sandbox.sandbox_id) is SandboxStatus.RUNNING


async def test_pids_limit_contains_a_fork_bomb(sandboxes: Any, agent_for: Any) -> None:
    sandboxes.harness.require("pids-limit")
    sandbox = await sandboxes.create(resources=RuntimeResources(pids=96))
    agent = agent_for(sandbox)
    result = await agent.sh("b() { b | b & }; b; sleep 2", timeout_s=3)
    assert result.status.timed_out or result.status.exit_code is not None
    await asyncio.sleep(0.2)
    assert (await agent.sh("echo alive")).stdout == b"alive\n"
