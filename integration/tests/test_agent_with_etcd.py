"""The foundation working together: a real etcd, a real agent process, one client.

This is the pattern the environment service is built on: a sandbox's record lives in etcd
under a lease, watchers are woken by its changes, and exec goes straight to the agent at the
address the record holds. Nothing here is a stand-in: etcd is the real server, the agent is
the real executable (the self-contained bundle when built, else the Python entry point).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchard.core.etcd import EmbeddedEtcd, EtcdStore, EventType
from orchard.inagent.v1 import inagent_service_pb2 as pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as pb_grpc
from orchard.types.v1 import exec_pb2

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "services/inagent/dist/orchard-inagent/orchard-inagent"


def agent_argv() -> list[str]:
    if BUNDLE.exists():
        return [str(BUNDLE)]
    return [str(Path(sys.executable).parent / "orchard-inagent")]


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[tuple[subprocess.Popen[bytes], str]]:
    socket_path = tmp_path / "agent.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
    process = subprocess.Popen(
        [*agent_argv(), "--listen", f"unix:{socket_path}", "--working-dir", str(tmp_path)],
        stderr=subprocess.DEVNULL,
        env=env,
    )
    address = f"unix:{socket_path}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 20
            while True:
                try:
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError:
                    pass
                assert process.poll() is None, "the agent exited before serving"
                assert time.monotonic() < deadline, "the agent did not serve within 20 s"
                await asyncio.sleep(0.01)
        yield process, address
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


# `etcd` is the workspace's session etcd (conftest.py at the root).
async def test_record_under_lease_drives_exec_and_expires(
    etcd: EmbeddedEtcd, agent: tuple[subprocess.Popen[bytes], str]
) -> None:
    process, address = agent
    async with (
        EtcdStore(etcd.endpoint, namespace="it/sandboxes/") as orchestrator,
        EtcdStore(etcd.endpoint, namespace="it/sandboxes/") as observer,
    ):
        start = await orchestrator.revision()
        watch = observer.watch_prefix("", start_revision=start + 1)
        await watch.start()
        lease = await orchestrator.grant_lease(2)
        record = {"id": "sbx-1", "state": "READY", "agent": address}
        await orchestrator.put("sbx-1", json.dumps(record), lease=lease)

        # Another replica finds the sandbox through the store alone and runs a command in it.
        found = await observer.get("sbx-1")
        assert found is not None and found.lease == lease.id
        target = json.loads(found.value)["agent"]
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.AgentServiceStub(channel)
            command = exec_pb2.Command(shell="echo $((6 * 7)); echo oops >&2; exit 5")
            result = (await stub.Exec(pb.ExecRequest(command=command))).result
        assert result.stdout == b"42\n"
        assert result.stderr == b"oops\n"
        assert result.status.exit_code == 5

        # A heartbeat keeps it; without one the lease expires and the watcher sees the delete.
        await orchestrator.refresh_lease(lease)
        async with asyncio.timeout(10):
            events = []
            async for event in watch:
                events.append(event)
                if event.type is EventType.DELETE:
                    break
        await watch.close()
        assert [e.type for e in events] == [EventType.PUT, EventType.DELETE]
        assert await orchestrator.get("sbx-1") is None

        # Reaping the runtime side: SIGTERM drains the agent, which exits 0 and removes its socket.
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 15) == 0
        assert not Path(address.removeprefix("unix:")).exists()
