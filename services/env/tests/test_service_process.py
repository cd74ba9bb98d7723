"""The real ``orchard-env`` process: configuration errors, and kill -9 under load then restart."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.core.etcd import EmbeddedEtcd
from orchard.env.v1 import env_pb2, env_service_pb2_grpc
from orchard.env.v1 import env_service_pb2 as api
from orchard.types.v1 import exec_pb2

TESTS = Path(__file__).resolve().parent
ENV = str(Path(sys.executable).parent / "orchard-env")
TOKEN = (("authorization", "Bearer alpha-token"),)


def test_missing_etcd_endpoint_is_a_clear_config_error() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
    done = subprocess.run([ENV], capture_output=True, text=True, env=env, timeout=30, check=False)
    assert done.returncode == 2
    assert "etcd.endpoints" in done.stderr


class EnvProcess:
    def __init__(self, tmp_path: Path, etcd: EmbeddedEtcd, prefix: str) -> None:
        self.socket = tmp_path / "env.sock"
        self.address = f"unix:{self.socket}"
        config = {
            "server": {"listen": [self.address], "grace_period_s": 1},
            "etcd": {"endpoints": [etcd.endpoint], "prefix": prefix},
            "auth": {"tenants": {"alpha": {"tokens": ["alpha-token"]}}},
            "runtime": {
                "type": "plugin",
                "factory": "unisolated_runtime:make",
                "state_dir": str(tmp_path / "runtime"),
            },
            "replica_ttl_s": 2,
            "images": {"allow_host": True},
            "secrets": {"key_file": str(tmp_path / "secrets.key")},
        }
        self.config_path = tmp_path / "env.json"
        self.config_path.write_text(json.dumps(config))  # JSON is YAML
        self.log = tmp_path / "env.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
        env["PYTHONPATH"] = str(TESTS)  # where the test runtime's module lives
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [ENV, "--config", str(self.config_path)], stderr=log, env=env
            )

    async def serving(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + 30
        async with grpc.aio.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                assert self.process is not None and self.process.poll() is None, (
                    self.log.read_text()[-3000:]
                )
                try:
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                assert time.monotonic() < deadline, self.log.read_text()[-3000:]
                await asyncio.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait()

    def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(30)


@pytest.fixture
def env_process(
    tmp_path: Path, etcd: EmbeddedEtcd, prefix: str, runtime: Any
) -> Iterator[EnvProcess]:
    # `runtime` shares tmp_path/"runtime": its teardown deletes every sandbox left there.
    process = EnvProcess(tmp_path, etcd, prefix)
    try:
        yield process
    finally:
        process.kill()


@pytest.mark.slow
async def test_kill_9_under_load_then_restart_loses_and_leaks_nothing(
    env_process: EnvProcess, runtime: Any
) -> None:
    env_process.start()
    await env_process.serving()
    async with grpc.aio.insecure_channel(env_process.address) as channel:
        stub = env_service_pb2_grpc.EnvServiceStub(channel)
        spec = env_pb2.SandboxSpec(image="host")
        ready_ids = []
        for _ in range(3):
            sandbox = (
                await stub.CreateSandbox(api.CreateSandboxRequest(spec=spec), metadata=TOKEN)
            ).sandbox
            ready_ids.append(sandbox.id)
        for sandbox_id in ready_ids:
            await stub.WaitSandbox(api.WaitSandboxRequest(sandbox_id=sandbox_id), metadata=TOKEN)

        # Load: execs running in every READY sandbox, and creations in flight.
        async def exec_loop(sandbox_id: str) -> None:
            command = exec_pb2.Command(shell="echo x")
            while True:
                await stub.Exec(
                    api.ExecRequest(sandbox_id=sandbox_id, command=command), metadata=TOKEN
                )

        loops = [asyncio.create_task(exec_loop(i)) for i in ready_ids]
        pending_ids = []
        for _ in range(4):
            sandbox = (
                await stub.CreateSandbox(api.CreateSandboxRequest(spec=spec), metadata=TOKEN)
            ).sandbox
            pending_ids.append(sandbox.id)
        await asyncio.sleep(0.3)
        env_process.kill()
        results = await asyncio.gather(*loops, return_exceptions=True)
        assert all(isinstance(r, grpc.aio.AioRpcError) for r in results), results

    env_process.start()
    await env_process.serving()
    async with grpc.aio.insecure_channel(env_process.address) as channel:
        stub = env_service_pb2_grpc.EnvServiceStub(channel)
        every = [*ready_ids, *pending_ids]
        for sandbox_id in every:
            request = api.WaitSandboxRequest(sandbox_id=sandbox_id)
            request.timeout.FromSeconds(20)
            sandbox = (await stub.WaitSandbox(request, metadata=TOKEN)).sandbox
            assert sandbox.state == env_pb2.SANDBOX_STATE_READY, sandbox
            result = (
                await stub.Exec(
                    api.ExecRequest(
                        sandbox_id=sandbox_id, command=exec_pb2.Command(shell="echo ok")
                    ),
                    metadata=TOKEN,
                )
            ).result
            assert result.stdout == b"ok\n"
        listed = await stub.ListSandboxes(api.ListSandboxesRequest(), metadata=TOKEN)
        assert sorted(s.id for s in listed.sandboxes) == sorted(every)
        # Nothing leaked: the runtime holds exactly the recorded sandboxes.
        assert sorted(await runtime.list_sandboxes()) == sorted(every)
        for sandbox_id in every:
            await stub.DeleteSandbox(
                api.DeleteSandboxRequest(sandbox_id=sandbox_id), metadata=TOKEN
            )
        assert await runtime.list_sandboxes() == []
    assert env_process.stop() == 0
