"""etcd faults never strand a sandbox: the service over a real etcd cluster (3 members, or
1), real agents, the leader killed or every member stopped while creations finish.

After each fault every sandbox ends READY or FAILED within a bound (WaitSandbox returns), and
the runtime holds exactly the READY sandboxes: nothing stuck, nothing leaked. Each run's
numbers go to the security suite's terminal summary. Also here: the repair of a creation whose
task died, the agent's version in the record, and a surviving replica watching the sandboxes
of one that died.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.core.config import ServerConfig
from orchard.core.etcd import EmbeddedEtcdCluster, EtcdStore
from orchard.env.config import (
    AuthConfig,
    EnvConfig,
    EtcdConfig,
    ImagesConfig,
    SecretsConfig,
    TenantConfig,
)
from orchard.env.main import EnvApplication
from orchard.env.records import SANDBOXES, SandboxRecord
from orchard.env.runtime.base import RuntimeSandbox, RuntimeSandboxSpec
from orchard.env.v1 import env_pb2, env_service_pb2_grpc
from orchard.env.v1 import env_service_pb2 as api
from orchard.inagent.version import __version__ as AGENT_VERSION

TOKEN = "etcd-faults-token"


@dataclass
class Replica:
    """One replica on the cluster and a client of it."""

    app: EnvApplication
    stub: env_service_pb2_grpc.EnvServiceStub

    def md(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {TOKEN}"),)

    async def wait(self, sandbox_id: str, timeout_s: float) -> env_pb2.Sandbox:
        request = api.WaitSandboxRequest(sandbox_id=sandbox_id)
        request.timeout.FromNanoseconds(int(timeout_s * 1e9))
        return (await self.stub.WaitSandbox(request, metadata=self.md())).sandbox


READY = env_pb2.SANDBOX_STATE_READY
FAILED = env_pb2.SANDBOX_STATE_FAILED
SETTLE_BOUND_S = 30.0


@dataclass
class FaultRun:
    """What one fault run did and left."""

    creates: int
    ready: int
    failed: int
    stuck: int
    leaked: int
    settle_s: float

    def line(self, name: str) -> str:
        return (
            f"{name}: creates {self.creates}, ready {self.ready}, failed {self.failed}, "
            f"stuck {self.stuck}, leaked {self.leaked}, settled {self.settle_s:.1f} s after the "
            "fault ended"
        )


@pytest.fixture
def summary(request: pytest.FixtureRequest) -> list[str]:
    """The security suite's summary lines (its conftest's), printed at the end of the run."""
    for plugin in request.config.pluginmanager.get_plugins():
        lines = getattr(plugin, "SUMMARY_LINES", None)
        if isinstance(lines, list):
            return lines
    return []


@pytest.fixture
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[EmbeddedEtcdCluster]:
    """3 members, or as many as the test's ``cluster`` parameter says."""
    async with EmbeddedEtcdCluster(getattr(request, "param", 3)) as started:
        yield started


def gate_runtime_starts(runtime: Any) -> tuple[list[str], asyncio.Event]:
    """Hold every runtime start, once made, until the event is set: the fault then hits
    creations whose last step (recording READY) is still to come."""
    made: list[str] = []
    release = asyncio.Event()
    original = runtime.create

    async def held(spec: RuntimeSandboxSpec) -> RuntimeSandbox:
        result: RuntimeSandbox = await original(spec)
        made.append(spec.sandbox_id)
        await release.wait()
        return result

    runtime.create = held
    return made, release


def report(summary: list[str], line: str) -> None:
    summary.append(line)
    print("\n" + line)


async def until(predicate: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def retried(call: Any, within: float = SETTLE_BOUND_S) -> Any:
    """A client's retry of UNAVAILABLE (what the SDK does), bounded."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def create_all(env: Any, count: int) -> list[str]:
    async def one() -> str:
        request = api.CreateSandboxRequest(
            spec=env_pb2.SandboxSpec(image="host"), request_id=uuid.uuid4().hex
        )
        request.spec.heartbeat_timeout.FromSeconds(600)
        reply = await retried(lambda: env.stub.CreateSandbox(request, metadata=env.md()))
        return str(reply.sandbox.id)

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def wait_all(env: Any, ids: list[str]) -> list[env_pb2.Sandbox]:
    async def one(sandbox_id: str) -> env_pb2.Sandbox:
        return await retried(lambda: env.wait(sandbox_id, timeout_s=SETTLE_BOUND_S))

    return list(await asyncio.gather(*(one(i) for i in ids)))


async def audit(
    cluster: EmbeddedEtcdCluster, prefix: str, runtime: Any, creates: int, settle_s: float
) -> FaultRun:
    """Every record in the store against the runtime's sandboxes."""
    async with EtcdStore(cluster.endpoints, namespace=prefix) as store:
        listing = await store.list_prefix(SANDBOXES)
    records = [SandboxRecord.from_kv(kv) for kv in listing.kvs]
    ready = {r.id for r in records if r.state == READY}
    failed = {r.id for r in records if r.state == FAILED}
    in_runtime = set(await runtime.list_sandboxes())
    return FaultRun(
        creates=creates,
        ready=len(ready),
        failed=len(failed),
        stuck=len(records) - len(ready) - len(failed),
        leaked=len(in_runtime ^ ready),
        settle_s=settle_s,
    )


@pytest.fixture
async def cluster_env(
    prefix: str, tmp_path: Path, runtime: Any, cluster: EmbeddedEtcdCluster
) -> AsyncIterator[Any]:
    """Starts one replica on every member of the cluster, ``first`` (a member's index)
    listed first: the member it talks to at start."""
    async with AsyncExitStack() as stack:

        async def start(first: int) -> Replica:
            endpoints = cluster.endpoints
            ordered = [endpoints[first]] + [e for i, e in enumerate(endpoints) if i != first]
            config = EnvConfig(
                server=ServerConfig(listen=["127.0.0.1:0"], grace_period_s=1),
                etcd=EtcdConfig(endpoints=ordered, prefix=prefix, timeout_s=1.0),
                auth=AuthConfig(tenants={"alpha": TenantConfig(tokens=[TOKEN])}),
                runtime={"type": "plugin", "factory": "unisolated_runtime:make"},
                reconcile_interval_s=5.0,
                images=ImagesConfig(allow_host=True),
                secrets=SecretsConfig(key_file=str(tmp_path / "secrets.key")),
            )
            app = EnvApplication(config, runtime=runtime)
            server = await stack.enter_async_context(app.server())
            await server.set_serving()
            channel = await stack.enter_async_context(
                grpc.aio.insecure_channel(server.addresses[0])
            )
            return Replica(app, env_service_pb2_grpc.EnvServiceStub(channel))

        yield start


@pytest.mark.slow
async def test_leader_killed_while_40_creations_finish(
    cluster_env: Any,
    runtime: Any,
    cluster: EmbeddedEtcdCluster,
    prefix: str,
    summary: list[str],
) -> None:
    count = 40
    made, release = gate_runtime_starts(runtime)
    leader = cluster.leader()
    env = await cluster_env(leader)
    ids = await create_all(env, count)
    await until(lambda: len(made) == count, 60, "every runtime start")
    # Every creation now records READY at once, on a channel the failover is about to close.
    release.set()
    await asyncio.sleep(0.005)
    cluster.kill_member(leader)
    fault_over = time.monotonic()
    sandboxes = await wait_all(env, ids)
    settle_s = time.monotonic() - fault_over
    assert all(s.state in (READY, FAILED) for s in sandboxes)
    run = await audit(cluster, prefix, runtime, count, settle_s)
    report(summary, run.line("etcd leader killed during 40 creates"))
    assert run.stuck == 0 and run.leaked == 0, run
    assert run.ready + run.failed == count, run
    assert settle_s < SETTLE_BOUND_S


@pytest.mark.slow
async def test_leader_killed_in_the_middle_of_40_create_calls(
    cluster_env: Any,
    runtime: Any,
    cluster: EmbeddedEtcdCluster,
    prefix: str,
    summary: list[str],
) -> None:
    """The fault lands anywhere: on create calls, their records' inserts, runtime starts."""
    count = 40
    leader = cluster.leader()
    env = await cluster_env(leader)
    burst = asyncio.create_task(create_all(env, count))
    await until(lambda: len(runtime.created) >= 5, 30, "the first runtime starts")
    cluster.kill_member(leader)
    fault_over = time.monotonic()
    ids = await burst
    sandboxes = await wait_all(env, ids)
    settle_s = time.monotonic() - fault_over
    assert all(s.state in (READY, FAILED) for s in sandboxes)
    run = await audit(cluster, prefix, runtime, count, settle_s)
    report(summary, run.line("etcd leader killed mid-burst of 40 create calls"))
    assert run.stuck == 0 and run.leaked == 0, run
    assert run.ready + run.failed == count, run
    assert settle_s < SETTLE_BOUND_S


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [1, 3], indirect=True, ids=["1-member", "3-members"])
async def test_full_etcd_outage_while_30_creations_finish(
    cluster_env: Any,
    runtime: Any,
    cluster: EmbeddedEtcdCluster,
    prefix: str,
    summary: list[str],
) -> None:
    count = 30
    made, release = gate_runtime_starts(runtime)
    env = await cluster_env(cluster.leader())
    ids = await create_all(env, count)
    await until(lambda: len(made) == count, 60, "every runtime start")
    for member in range(cluster.size):
        cluster.kill_member(member)
    release.set()  # every runtime start finishes while etcd is gone
    await asyncio.sleep(3)
    for member in range(cluster.size):
        cluster.start_member(member, wait=False)
    await asyncio.to_thread(cluster.wait_ready)
    back = time.monotonic()
    sandboxes = await wait_all(env, ids)
    settle_s = time.monotonic() - back
    assert all(s.state in (READY, FAILED) for s in sandboxes)
    run = await audit(cluster, prefix, runtime, count, settle_s)
    members = f"{cluster.size} of {cluster.size} members"
    report(summary, run.line(f"full etcd outage ({members} stopped 3 s) during 30 creates"))
    assert run.stuck == 0 and run.leaked == 0, run
    assert run.ready == count, run  # the runtime starts succeeded: the outage costs nothing
    assert settle_s < SETTLE_BOUND_S


async def test_a_creation_task_that_dies_is_repaired(env: Any, runtime: Any) -> None:
    """A creation whose task ends in an unexpected error is noticed and finished, not left
    PENDING behind this replica's live creating key."""
    creation = env.app.controller.creation
    original = creation._settle_ready
    calls: list[str] = []

    async def broken_once(record: Any, made: Any, started: float) -> None:
        calls.append(record.id)
        if len(calls) == 1:
            raise RuntimeError("boom")
        await original(record, made, started)

    creation._settle_ready = broken_once
    sandbox = await env.create()
    ready = await env.wait(sandbox.id, timeout_s=10)
    assert ready.state == READY, ready
    assert calls == [sandbox.id, sandbox.id]
    assert await runtime.list_sandboxes() == [sandbox.id]


async def test_reconcile_repairs_a_creation_of_this_replica_that_no_task_runs(
    env: Any, runtime: Any
) -> None:
    """A PENDING record behind this replica's own (live) creating key with no creation
    running: before, reconcile skipped it and it stayed PENDING until its lease ran out."""
    from orchard.env.controller import new_sandbox_id

    controller = env.app.controller
    lease = await controller.store.grant_lease(600)
    sandbox = env_pb2.Sandbox(
        id=new_sandbox_id(),
        tenant="alpha",
        spec=env_pb2.SandboxSpec(image="host"),
        state=env_pb2.SANDBOX_STATE_PENDING,
        runtime=runtime.name,
    )
    record = SandboxRecord(sandbox)
    creation = controller.creation
    result = await creation._insert([(record, lease.id)], "", [])  # no creation started
    assert result.succeeded
    creation._inserting.discard(record.id)
    done = await controller.reconcile()
    assert done["repaired"] == 1, done
    ready = await env.wait(record.id, timeout_s=10)
    assert ready.state == READY, ready
    assert await runtime.list_sandboxes() == [record.id]


async def test_agent_version_is_recorded(env: Any, runtime: Any) -> None:
    """A runtime that does not say which agent it started: the service asks the agent (over
    gRPC, which an agent with a lane is first asked to start there)."""
    original = runtime.create

    async def silent(spec: RuntimeSandboxSpec) -> RuntimeSandbox:
        made: RuntimeSandbox = await original(spec)
        return RuntimeSandbox(made.sandbox_id, made.agent_address, lane_address=made.lane_address)

    runtime.create = silent
    ready = await env.ready()
    assert ready.agent_version == AGENT_VERSION
    got = await env.stub.GetSandbox(api.GetSandboxRequest(sandbox_id=ready.id), metadata=env.md())
    assert got.sandbox.agent_version == AGENT_VERSION


@pytest.mark.root
async def test_local_sandbox_reports_its_agent_version(
    env_factory: Any, local_runtime: Any
) -> None:
    env = await env_factory(runtime=local_runtime)
    ready = await env.ready(timeout_s=30)
    assert ready.agent_version == AGENT_VERSION


async def test_surviving_replica_notices_an_agent_death_at_once(
    env_factory: Any, tmp_path: Path
) -> None:
    """A sandbox made by a replica that died: the other replica hears of its agent's exit at
    once, not at its next reconcile (an hour away here)."""
    from unisolated_runtime import UnisolatedProcessRuntime

    state_dir = tmp_path / "runtime"
    first, second = UnisolatedProcessRuntime(state_dir), UnisolatedProcessRuntime(state_dir)
    await first.start()
    await second.start()
    try:
        a = await env_factory(runtime=first, reconcile_interval_s=3600)
        b = await env_factory(runtime=second, reconcile_interval_s=3600)
        sandbox = await a.ready()
        await a.server.stop(0)  # replica A dies; its runtime stops watching
        await first.close()
        pid = first._pid(sandbox.id)
        assert pid is not None
        await asyncio.sleep(0.2)  # B has seen the READY record by now
        killed = time.monotonic()
        os.killpg(pid, signal.SIGKILL)
        request = api.GetSandboxRequest(sandbox_id=sandbox.id)
        while True:
            got = (await b.stub.GetSandbox(request, metadata=b.md())).sandbox
            if got.state == FAILED:
                break
            assert time.monotonic() - killed < 2, got
            await asyncio.sleep(0.02)
        assert got.failure.reason == "AGENT_EXITED", got
    finally:
        for sandbox_id in await second.list_sandboxes():
            await second.delete(sandbox_id)
        await second.close()
        await first.close()


@pytest.mark.root
async def test_local_runtime_adopts_a_sandbox_another_process_started(local_runtime: Any) -> None:
    """A second runtime on the same host (a surviving replica's) that started before the
    sandbox existed: after ``adopt`` it reports the agent's death at once."""
    from orchard.env.runtime.local import LocalRuntime

    other = LocalRuntime(local_runtime.config)
    await other.start()  # nothing to adopt yet
    try:
        made = await local_runtime.create(
            RuntimeSandboxSpec(sandbox_id="sbx-adopt-0001", image="host")
        )
        await other.adopt(made.sandbox_id)
        await other.adopt(made.sandbox_id)  # idempotent
        state = other.store.read(made.sandbox_id)
        assert state is not None and state.pid
        exits = other.exits()
        killed = time.monotonic()
        os.kill(state.pid, signal.SIGKILL)
        event = await asyncio.wait_for(anext(exits), 2)
        assert event.sandbox_id == made.sandbox_id
        assert time.monotonic() - killed < 2
    finally:
        await other.close()


@pytest.mark.root
async def test_surviving_replica_notices_an_agent_death_at_once_local(
    env_factory: Any, local_runtime: Any
) -> None:
    """The same over the real ``local`` runtime: replica A (its own runtime object, as another
    process would have) creates a sandbox and dies; B's runtime had started before it."""
    from orchard.env.runtime.local import LocalRuntime

    first = LocalRuntime(local_runtime.config)
    await first.start()
    try:
        a = await env_factory(runtime=first, reconcile_interval_s=3600)
        b = await env_factory(runtime=local_runtime, reconcile_interval_s=3600)
        sandbox = await a.ready(timeout_s=30)
        await a.server.stop(0)
        await first.close()
        state = local_runtime.store.read(sandbox.id)
        assert state is not None and state.pid
        await asyncio.sleep(0.2)
        killed = time.monotonic()
        os.kill(state.pid, signal.SIGKILL)
        request = api.GetSandboxRequest(sandbox_id=sandbox.id)
        while True:
            got = (await b.stub.GetSandbox(request, metadata=b.md())).sandbox
            if got.state == FAILED:
                break
            assert time.monotonic() - killed < 2, got
            await asyncio.sleep(0.02)
        assert got.failure.reason == "AGENT_EXITED", got
    finally:
        await first.close()
