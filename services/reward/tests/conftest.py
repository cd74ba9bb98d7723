"""Fixtures for the tests that score in real sandboxes: a private orchard-env (etcd and the
local runtime; root) per test module, and the REAL reward gRPC server pointed at it; and a
reward server without sandboxes whose judges are the scripted one and an unreachable model."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from orchard.core.config import ServerConfig
from orchard.reward.config import (
    EnvServiceConfig,
    JudgeConfig,
    RewardConfig,
    ScriptedJudgeConfig,
)
from orchard.reward.main import RewardApplication
from orchard.reward.v1 import reward_service_pb2_grpc
from orchard.sdk.cli.host_probe import remove_cgroup_parent
from orchard.sdk.cli.stack import LocalStack, StackError

TOKEN_ENV = "REWARD_TEST_ENV_TOKEN"


@pytest.fixture
async def scripted_stub() -> AsyncIterator[reward_service_pb2_grpc.RewardServiceStub]:
    """A real reward server whose judges are ``scripted`` and the default ``model``, an
    endpoint where nothing listens (a call to it gets no answer: EXCLUDED)."""
    config = RewardConfig(
        server=ServerConfig(listen=["127.0.0.1:0"]),
        judges={
            "model": JudgeConfig(
                base_url=f"http://127.0.0.1:{_free_port()}/v1", model="m", max_attempts=1
            ),
            "scripted": ScriptedJudgeConfig(kind="scripted"),
        },
        default_judge="model",
    )
    async with RewardApplication(config).server() as server:
        await server.set_serving()
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            yield reward_service_pb2_grpc.RewardServiceStub(channel)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def env_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """etcd and orchard-env with their own cgroup parent and run dir, removed at the end."""
    if os.geteuid() != 0:
        pytest.fail("the local runtime needs root: run the tests as root")
    run_dir = Path(tempfile.mkdtemp(prefix="or-"))  # sandbox socket paths must stay short
    cgroup_parent = f"orchard-reward-{uuid.uuid4().hex[:8]}"
    stack = LocalStack(
        tmp_path_factory.mktemp("reward-stack"),
        listen=f"127.0.0.1:{_free_port()}",
        token=secrets.token_urlsafe(16),
        runtime={"cgroup_parent": cgroup_parent, "run_dir": str(run_dir)},
    )
    try:
        stack.start()
        yield stack
    except StackError as exc:
        pytest.fail(str(exc))
    finally:
        stack.stop()
        remove_cgroup_parent(cgroup_parent)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env_reward(
    env_stack: LocalStack,
) -> AsyncIterator[reward_service_pb2_grpc.RewardServiceStub]:
    """The reward server with ``env.endpoint`` set to the stack's orchard-env."""
    os.environ[TOKEN_ENV] = env_stack.token
    config = RewardConfig(
        server=ServerConfig(listen=["127.0.0.1:0"]),
        env=EnvServiceConfig(endpoint=env_stack.endpoint, token_env=TOKEN_ENV),
    )
    try:
        async with RewardApplication(config).server() as server:
            await server.set_serving()
            async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
                yield reward_service_pb2_grpc.RewardServiceStub(channel)
    finally:
        os.environ.pop(TOKEN_ENV, None)
