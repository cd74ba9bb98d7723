"""A state store that stops answering for a while (a busy etcd, a partition, a process starved
past its deadlines) is a retryable fault, not a bug: the REAL rollout gRPC server answers
UNAVAILABLE where it used to answer INTERNAL with an incident id, and the recipe's client
(`orchard.recipes.rollout_client.RolloutJobs`) tries again, a broken group stream opening again
at the first group it has not read, so a recipe hours long does not fail on one slow read.

etcd is a real server of the test's own, stalled with SIGSTOP and resumed with SIGCONT; the job
is written to it the way another replica running it would (claimed on that replica's lease, so
this service only serves it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import grpc
import pytest

from orchard.core.config import ServerConfig
from orchard.core.errors import error_info
from orchard.core.etcd import EmbeddedEtcd, EtcdStore
from orchard.recipes.rollout_client import RolloutJobs
from orchard.rollout.config import RolloutConfig
from orchard.rollout.job_store import JobState, JobStore, new_job_id
from orchard.rollout.main import RolloutApplication
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.rollout.v1 import rollout_service_pb2_grpc
from orchard.types.v1 import trajectory_pb2

NAMESPACE = "stall/"
STORE_TIMEOUT_S = 1.0


@pytest.fixture
def etcd() -> Iterator[EmbeddedEtcd]:
    """An etcd of this test's own: it is stopped and resumed, which the shared one must not be."""
    with EmbeddedEtcd() as server:
        yield server


@contextmanager
def stalled(etcd: EmbeddedEtcd) -> Iterator[None]:
    """etcd frozen (it holds its connections open and answers nothing) until the block ends."""
    assert etcd.pid is not None
    os.kill(etcd.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(etcd.pid, signal.SIGCONT)


@asynccontextmanager
async def rollout_service(etcd: EmbeddedEtcd, folder: Path) -> AsyncIterator[str]:
    """orchard-rollout on loopback whose etcd calls give up after `STORE_TIMEOUT_S` and whose
    streams read their groups again every half second; its address."""
    config = RolloutConfig(
        server=ServerConfig(listen=["127.0.0.1:0"]),
        artifacts={"root": (folder / "artifacts").as_uri()},
        etcd={"endpoints": [etcd.endpoint], "namespace": NAMESPACE, "timeout_s": STORE_TIMEOUT_S},
        env={"endpoint": "127.0.0.1:9"},
        jobs={"recheck_interval_s": 0.5},
    )
    async with RolloutApplication(config).server() as server:
        await server.set_serving()
        yield server.addresses[0]


def _group(index: int) -> trajectory_pb2.TrajectoryGroup:
    return trajectory_pb2.TrajectoryGroup(id=f"group-{index}", task_id="t1", sampler="fixed_n")


@asynccontextmanager
async def job_elsewhere(etcd: EmbeddedEtcd) -> AsyncIterator[tuple[JobStore, JobState]]:
    """A running job claimed by another replica (on its own live lease) with two groups."""
    async with EtcdStore([etcd.endpoint], namespace=NAMESPACE) as store:
        lease = await store.grant_lease(120)
        jobs = JobStore(store)
        job = JobState(id=new_job_id(), spec=api.RolloutJobSpec(tasks=[api.RolloutTask(id="t1")]))
        await jobs.create(job, owner="replica-elsewhere", lease=lease.id)
        for index in range(2):
            await jobs.emit(job, _group(index))
        yield jobs, job


async def _status(call: Awaitable[object]) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    info = error_info(caught.value)
    return caught.value.code(), caught.value.details() or "", info.reason if info else ""


async def _drained(stream: AsyncIterator[object]) -> None:
    async for _ in stream:
        pass


async def test_a_stalled_state_store_is_unavailable_not_an_internal_error(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    async with (
        job_elsewhere(etcd) as (_, job),
        rollout_service(etcd, tmp_path) as address,
        grpc.aio.insecure_channel(address) as channel,
    ):
        stub = rollout_service_pb2_grpc.RolloutServiceStub(channel)
        with stalled(etcd):
            get = stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=job.id), timeout=30)
            stream = stub.StreamGroups(api.StreamGroupsRequest(job_id=job.id), timeout=30)
            for call in (get, _drained(stream)):
                code, details, reason = await _status(call)
                assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"), details
                assert "state store" in details and "incident" not in details, details
        # Once etcd answers again, so does the service.
        got = await stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=job.id), timeout=30)
        assert got.job.groups_emitted == 2


async def test_the_recipe_s_group_stream_resumes_where_a_stalled_store_broke_it(
    etcd: EmbeddedEtcd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        job_elsewhere(etcd) as (jobs, job),
        rollout_service(etcd, tmp_path) as address,
        RolloutJobs(address) as client,
    ):
        groups: list[trajectory_pb2.TrajectoryGroup] = []
        read_two = asyncio.Event()

        def enough(read: list[trajectory_pb2.TrajectoryGroup]) -> bool:
            if len(read) >= 2:
                read_two.set()
            return False  # all of them, to the job's end

        with caplog.at_level(logging.WARNING, logger="orchard.recipes.connection"):
            streaming = asyncio.create_task(client._stream(job.id, groups, enough))
            async with asyncio.timeout(30):
                await read_two.wait()
            # The open stream reads the store again within half a second and finds it silent.
            with stalled(etcd):
                await asyncio.sleep(3 * STORE_TIMEOUT_S)
            await jobs.emit(job, _group(2))
            job.state = api.ROLLOUT_JOB_STATE_SUCCEEDED
            await jobs.put(job)
            async with asyncio.timeout(60):
                await streaming
        retried = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
        # Each group once, in order, across the broken streams.
        assert [g.id for g in groups] == ["group-0", "group-1", "group-2"]
        assert retried and all("UNAVAILABLE" in m for m in retried), retried
        # The client's job view is right too, read through the same retrying calls.
        assert (await client.get(job.id)).state == api.ROLLOUT_JOB_STATE_SUCCEEDED
