"""Bytes that are not protobuf, sent to a real ``orchard-env`` process: each call gets
INVALID_ARGUMENT (UNAUTHENTICATED without a valid token, checked first), and a flood of them
leaves a few rate-limited lines in the log instead of a traceback each."""

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

from orchard.core.errors import error_info
from orchard.core.etcd import EmbeddedEtcd

pytestmark = [pytest.mark.root]

TESTS = Path(__file__).resolve().parents[1]
ENV = str(Path(sys.executable).parent / "orchard-env")
TOKEN = (("authorization", "Bearer alpha-token"),)
CALLS = 1000
# Not a message: field number 0 with a truncated varint, for every request type.
GARBAGE = b"\x00\xff\xff\xff"


class EnvProcess:
    """``orchard-env`` on a Unix socket over the test runtime, its stderr in a file."""

    def __init__(self, tmp_path: Path, etcd: EmbeddedEtcd, prefix: str) -> None:
        self.address = f"unix:{tmp_path / 'env.sock'}"
        config = {
            "server": {"listen": [self.address], "grace_period_s": 1},
            "etcd": {"endpoints": [etcd.endpoint], "prefix": prefix},
            "auth": {"tenants": {"alpha": {"tokens": ["alpha-token"]}}},
            "runtime": {
                "type": "plugin",
                "factory": "unisolated_runtime:make",
                "state_dir": str(tmp_path / "runtime"),
            },
            "secrets": {"key_file": str(tmp_path / "secrets.key")},
        }
        self.config_path = tmp_path / "env.json"
        self.config_path.write_text(json.dumps(config))
        self.log = tmp_path / "env.log"
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
                assert self.process.poll() is None, self.log.read_text()[-3000:]
                try:
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                assert time.monotonic() < deadline, self.log.read_text()[-3000:]
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def env_process(
    tmp_path: Path, etcd: EmbeddedEtcd, prefix: str, runtime: Any
) -> Iterator[EnvProcess]:
    process = EnvProcess(tmp_path, etcd, prefix)
    try:
        yield process
    finally:
        process.stop()


async def flood(
    channel: grpc.aio.Channel, method: str, metadata: Any, *, stream: bool = False
) -> dict[str, int]:
    """Send GARBAGE to ``method`` CALLS times (50 at once); count the status codes."""
    if stream:
        call = channel.stream_unary(method, request_serializer=None, response_deserializer=None)
    else:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    codes: dict[str, int] = {}
    reasons: set[str] = set()

    async def one() -> None:
        try:
            request: Any = iter([GARBAGE]) if stream else GARBAGE
            await call(request, metadata=metadata, timeout=30)
            code = "OK"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            info = error_info(exc)
            reasons.add(info.reason if info is not None else "-")
        codes[code] = codes.get(code, 0) + 1

    for start in range(0, CALLS, 50):
        await asyncio.gather(*(one() for _ in range(min(50, CALLS - start))))
    codes["reasons"] = len(reasons)
    assert len(reasons) == 1, reasons
    return codes


async def test_garbage_requests_are_refused_cheaply_after_authentication(
    env_process: EnvProcess, attack: Any
) -> None:
    await env_process.serving()
    before = env_process.log.stat().st_size
    async with grpc.aio.insecure_channel(env_process.address) as channel:
        attack.tried("1,000 malformed CreateSandbox requests with a valid token")
        codes = await flood(channel, "/orchard.env.v1.EnvService/CreateSandbox", TOKEN)
        assert codes == {"INVALID_ARGUMENT": CALLS, "reasons": 1}, codes
        attack.held("1,000 malformed CreateSandbox requests with a valid token")

        attack.tried("1,000 malformed GetSandbox requests without a token")
        codes = await flood(channel, "/orchard.env.v1.EnvService/GetSandbox", ())
        assert codes == {"UNAUTHENTICATED": CALLS, "reasons": 1}, codes
        attack.held("1,000 malformed GetSandbox requests without a token")

        attack.tried("1,000 malformed WriteFile streams with a wrong token")
        wrong = (("authorization", "Bearer not-a-token"),)
        codes = await flood(channel, "/orchard.env.v1.EnvService/WriteFile", wrong, stream=True)
        assert codes == {"UNAUTHENTICATED": CALLS, "reasons": 1}, codes
        attack.held("1,000 malformed WriteFile streams with a wrong token")

        # What a malformed call is told names the method and the parser's words.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(
                "/orchard.env.v1.EnvService/ListSandboxes",
                request_serializer=None,
                response_deserializer=None,
            )(GARBAGE, metadata=TOKEN, timeout=10)
        info = error_info(caught.value)
        assert info is not None and info.reason == "MALFORMED_REQUEST"
        assert "ListSandboxes" in (caught.value.details() or "")
    await asyncio.sleep(0.2)
    grown = env_process.log.stat().st_size - before
    text = env_process.log.read_bytes()[before:].decode(errors="replace")
    assert grown < 4096, text[-3000:]
    assert "Traceback" not in text and "UNKNOWN" not in text, text[-3000:]
    assert env_process.process.poll() is None
