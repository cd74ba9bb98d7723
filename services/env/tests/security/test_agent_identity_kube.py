"""On the kubernetes runtime, orchard-env talks only to the agent it launched: the service
reaches the agent at its Pod IP, where something else could answer (a process of the Pod that
outlived the agent, a later Pod given the IP, another sandbox's agent). Each sandbox has a key
only its agent holds; before the first call (per replica, also after a restart) the agent must
prove it holds it over a fresh nonce.

Runs against the Kubernetes API test double (``services/env/tests/kube``), whose Pods are real
processes running the real agent bundle with the container's capabilities.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import importlib.util
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.core.errors import error_info
from orchard.core.etcd import EmbeddedEtcd, EtcdStore
from orchard.inagent.v1 import inagent_service_pb2 as pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as pb_grpc
from orchard.types.v1 import exec_pb2

pytestmark = [pytest.mark.root, pytest.mark.slow]

KUBE_TESTS = Path(__file__).resolve().parent.parent / "kube"
FORGED = b"forged-by-an-impostor"


def _kube_module(name: str) -> Any:
    """The test double's modules by path, shared with the kube tests' own loading."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, KUBE_TESTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_kube_module("kube_api_double")
kube = _kube_module("kube_harness")


@pytest.fixture(scope="module")
def kube_images(tmp_path_factory: pytest.TempPathFactory) -> Any:
    reason = kube.unavailable()
    if reason:
        pytest.fail(reason)
    busybox = kube.build_busybox_root(tmp_path_factory.mktemp("kube-busybox"))
    bundle = kube.build_bundle_layer(tmp_path_factory.mktemp("kube-inagent"))
    return kube.catalog(busybox, bundle)


@pytest.fixture
async def double(tmp_path: Path, kube_images: Any) -> AsyncIterator[Any]:
    async with kube.started_double(tmp_path / "kube", kube_images, bookmark_interval_s=0.2) as d:
        yield d


@pytest.fixture
async def runtimes(double: Any) -> AsyncIterator[Callable[..., Any]]:
    """Starts kubernetes runtimes on the double (a restart: a new one with the first one's
    deployment); deletes their sandboxes and closes them at the end."""
    from orchard.env.runtime.kubernetes import KubernetesRuntime

    made: list[Any] = []

    async def start(**overrides: Any) -> Any:
        runtime = KubernetesRuntime(kube.runtime_config(double, **overrides))
        await runtime.start()
        made.append(runtime)
        return runtime

    yield start
    if made:
        for sandbox_id in await made[-1].list_sandboxes():
            await made[-1].delete(sandbox_id)
    for runtime in made:
        await runtime.close()
    assert kube.leftovers(double, set(double_ids(double))) == []


def double_ids(double: Any) -> list[str]:
    return [
        (obj["metadata"].get("labels") or {}).get("orchard.dev/sandbox-id", "")
        for resource in ("pods", "secrets", "networkpolicies")
        for obj in double.objects(resource, kube.NAMESPACE)
    ]


def sandbox_key(double: Any, sandbox_id: str) -> bytes:
    secret = double.get("secrets", kube.NAMESPACE, f"{sandbox_id}-agent-key")
    assert secret is not None, f"sandbox {sandbox_id} has no key Secret"
    return base64.b64decode(secret["data"]["agent-key"])


def pod_address(double: Any, sandbox_id: str, port: int) -> tuple[str, int]:
    return double.get("pods", kube.NAMESPACE, sandbox_id)["status"]["podIP"], port


class Impostor(pb_grpc.AgentServiceServicer):
    """Serves AgentService without the key: forges a proof and every Exec result."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def ProveIdentity(self, request: Any, context: Any) -> Any:
        self.calls.append("ProveIdentity")
        return pb.ProveIdentityResponse(proof=os.urandom(32), version="0.1.0")

    async def Exec(self, request: Any, context: Any) -> Any:
        self.calls.append("Exec")
        return pb.ExecResponse(result=exec_pb2.ExecResult(stdout=FORGED))


@contextlib.asynccontextmanager
async def impostor_at(host: str, port: int) -> AsyncIterator[Impostor]:
    impostor = Impostor()
    server = grpc.aio.server()
    pb_grpc.add_AgentServiceServicer_to_server(impostor, server)
    deadline = time.monotonic() + 10
    while True:  # the dead agent's port frees up once its process is gone
        try:
            server.add_insecure_port(f"{host}:{port}")
            break
        except RuntimeError:
            assert time.monotonic() < deadline, f"{host}:{port} never came free"
            await asyncio.sleep(0.05)
    await server.start()
    try:
        yield impostor
    finally:
        await server.stop(0)


@contextlib.contextmanager
def keyless_agent(directory: Path) -> Any:
    """The real agent bundle, started without ORCHARD_AGENT_KEY, on a loopback port."""
    from orchard.env.runtime.local.config import default_agent_bundle

    address_file = directory / "agent.addr"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
    process = subprocess.Popen(
        [
            os.path.join(default_agent_bundle(), "orchard-inagent"),
            "--listen",
            "127.0.0.1:0",
            "--address-file",
            str(address_file),
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not address_file.exists():
            assert process.poll() is None and time.monotonic() < deadline, "agent did not start"
            time.sleep(0.01)
        yield address_file.read_text().split()[0]
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def test_an_impostor_at_the_agents_address_is_refused_after_a_restart(
    env_factory: Any, runtimes: Callable[..., Any], double: Any, attack: Any
) -> None:
    first_runtime = await runtimes()
    first = await env_factory(runtime=first_runtime)
    sandbox = await first.ready(image=kube.BUSYBOX_IMAGE)
    host, port = pod_address(double, sandbox.id, first_runtime.config.agent_port)
    await first.server.stop(0)

    attack.tried("serve an impostor agent at the Pod IP once the agent is gone")
    # The agent dies and the Pod still reads Running and Ready (a kubelet that has not noticed,
    # or a process of the Pod that outlived it); the impostor takes the agent's address.
    double.kill_container(kube.NAMESPACE, sandbox.id, noticed=False)
    async with impostor_at(host, port) as impostor:
        second = await env_factory(
            runtime=await runtimes(deployment=first_runtime.config.deployment)
        )
        for _ in range(2):  # refused every time: a refusal is never cached as a link
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await second.shell(sandbox.id, "echo hello")
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value
            info = error_info(caught.value)
            assert info is not None and info.reason == "AGENT_NOT_VERIFIED", caught.value
        assert impostor.calls == ["ProveIdentity", "ProveIdentity"]  # nothing else was sent
    attack.held("serve an impostor agent at the Pod IP once the agent is gone")


@pytest.fixture
def stored_values(etcd: EmbeddedEtcd, prefix: str) -> Callable[[], Any]:
    """Reads every key and value the service wrote to etcd (its prefix), as etcd holds them."""

    async def read() -> list[tuple[bytes, bytes]]:
        store = EtcdStore([etcd.endpoint])
        await store.connect()
        try:
            return [(kv.key, kv.value) for kv in (await store.get_prefix(prefix)).kvs]
        finally:
            await store.close()

    return read


async def test_a_restarted_service_verifies_the_real_agent_and_the_key_stays_hidden(
    env_factory: Any,
    runtimes: Callable[..., Any],
    double: Any,
    stored_values: Callable[[], Any],
    attack: Any,
) -> None:
    first_runtime = await runtimes()
    first = await env_factory(runtime=first_runtime)
    sandbox = await first.ready(image=kube.BUSYBOX_IMAGE)
    key = sandbox_key(double, sandbox.id)

    attack.tried("read the agent key from inside the sandbox")
    seen = await first.shell(
        sandbox.id,
        "env; cat /proc/self/environ; cat /proc/1/environ; ls -l /proc/1/fd; "
        "grep -a AGENT_KEY /proc/1/mem; true",
    )
    leaked = seen.stdout + seen.stderr
    assert key not in leaked and b"ORCHARD_AGENT_KEY" not in leaked, seen
    assert b"'/proc/1/environ': Permission denied" in seen.stderr, seen
    attack.held("read the agent key from inside the sandbox")

    attack.tried("find the agent key in etcd")
    stored = await stored_values()
    assert stored
    for raw in (key, base64.b64encode(key)):
        assert not any(raw in k or raw in v for k, v in stored)
    attack.held("find the agent key in etcd")

    # orchard-env restarts: a new replica over a new runtime reads the key once and verifies.
    await first.server.stop(0)
    reads = double.count("GET", f"/secrets/{sandbox.id}-agent-key")
    second = await env_factory(runtime=await runtimes(deployment=first_runtime.config.deployment))
    for _ in range(3):
        assert (await second.shell(sandbox.id, "echo real-$((6 * 7))")).stdout == b"real-42\n"
    assert double.count("GET", f"/secrets/{sandbox.id}-agent-key") == reads + 1


async def test_verify_agent_refuses_whatever_does_not_hold_the_sandboxs_key(
    runtimes: Callable[..., Any], double: Any, tmp_path: Path, attack: Any
) -> None:
    from orchard.env.runtime.base import RuntimeSandboxSpec

    runtime = await runtimes()
    made = [
        await runtime.create(
            RuntimeSandboxSpec(sandbox_id=f"sb-{uuid.uuid4().hex[:10]}", image=kube.BUSYBOX_IMAGE)
        )
        for _ in range(2)
    ]
    one, other = made
    assert one.agent_version  # proven at create
    assert await runtime.verify_agent(one.sandbox_id, one.agent_address)

    attack.tried("answer for a sandbox with another sandbox's agent")
    assert not await runtime.verify_agent(one.sandbox_id, other.agent_address)
    attack.held("answer for a sandbox with another sandbox's agent")

    attack.tried("answer for a sandbox with an agent started without its key")
    with keyless_agent(tmp_path) as address:
        assert not await runtime.verify_agent(one.sandbox_id, address)
    attack.held("answer for a sandbox with an agent started without its key")

    attack.tried("share the agent's port (SO_REUSEPORT) from the Pod's network")
    host, port = pod_address(double, one.sandbox_id, runtime.config.agent_port)
    with socket.socket() as sharer:
        sharer.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sharer.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError) as refused:
            sharer.bind((host, port))
        assert refused.value.errno == errno.EADDRINUSE
    attack.held("share the agent's port (SO_REUSEPORT) from the Pod's network")

    # A restarted runtime (nothing in memory) reads the key from the Secret and still accepts
    # the real agent; without the Secret nothing can be verified.
    restarted = await runtimes(deployment=runtime.config.deployment)
    assert await restarted.verify_agent(one.sandbox_id, one.agent_address)
    assert await restarted.verify_agent(other.sandbox_id, other.agent_address)
    await runtime.delete(other.sandbox_id)
    assert double.get("secrets", kube.NAMESPACE, f"{other.sandbox_id}-agent-key") is None
