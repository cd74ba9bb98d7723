"""The service's job parts against a REAL etcd: the job store's retention and key paging, the
scheduler's claims and adoption, group streams woken by the etcd watch (with the latency they
see), and the watch across an etcd restart and a compaction.

Replicas here are schedulers and managers in this process, each with its own etcd client and
lease, as two service processes would hold them; only the launcher (what a claimed job runs) is
a stand-in, since running a job needs the environment service (the service tests with real
processes are in integration/tests/test_rollout_service.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import grpc
import pytest

from orchard.core.errors import OrchardError, Reason
from orchard.core.etcd import EmbeddedEtcd, EmbeddedEtcdCluster, EtcdStore, LeaseNotFound
from orchard.rollout.config import RolloutConfig
from orchard.rollout.errors import RolloutReason
from orchard.rollout.job_events import JobEvents
from orchard.rollout.job_store import (
    GROUPS,
    JOBS,
    OWNERS,
    REQUESTS,
    JobState,
    JobStore,
    decode_page_token,
    new_job_id,
)
from orchard.rollout.metrics import RolloutMetrics
from orchard.rollout.scheduler import JobScheduler, Work
from orchard.rollout.service import RolloutManager
from orchard.rollout.streams import GroupStreams
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.types.v1 import trajectory_pb2

CHECK = json.dumps({"check": {"command": "true"}})


def spec() -> api.RolloutJobSpec:
    return api.RolloutJobSpec(
        tasks=[api.RolloutTask(id="t1", instruction="do it", scorer_json=CHECK)],
        harnesses=["builtin:bash"],
    )


def group(name: str) -> trajectory_pb2.TrajectoryGroup:
    return trajectory_pb2.TrajectoryGroup(id=name, task_id="t1")


@pytest.fixture
def namespace() -> str:
    return f"rollout-sched-{uuid.uuid4().hex}/"


@pytest.fixture
async def store(etcd: EmbeddedEtcd, namespace: str) -> AsyncIterator[EtcdStore]:
    async with EtcdStore(etcd.endpoint, namespace=namespace) as s:
        yield s


async def put_raw(jobs: JobStore, job: JobState) -> None:
    """Writes the record as given (`put` would stamp update_time now)."""
    await jobs.store.put(JOBS + job.id, job.to_json())


# -- retention -------------------------------------------------------------------------------


async def test_ended_jobs_leave_with_their_groups_after_the_retention(store: EtcdStore) -> None:
    jobs = JobStore(store)
    now = time.time()
    old = JobState(id=new_job_id(), spec=spec(), request_id="req-old")
    await jobs.create(old)
    for name in ("a", "b"):
        await jobs.emit(old, group(name))
    await jobs.mark_cancelled(old.id)
    old.state, old.update_time = api.ROLLOUT_JOB_STATE_CANCELLED, now - 100
    await put_raw(jobs, old)
    # Running for long, and ended only a moment ago: both stay.
    running = JobState(id=new_job_id(), spec=spec(), create_time=now - 1000)
    running.update_time = now - 1000
    await put_raw(jobs, running)
    recent = JobState(id=new_job_id(), spec=spec(), state=api.ROLLOUT_JOB_STATE_SUCCEEDED)
    await jobs.put(recent)
    await jobs.emit(recent, group("r"))

    metrics = [RolloutMetrics(None) for _ in range(3)]
    schedulers = [
        JobScheduler(jobs, JobEvents(store), _Launcher(), m, retention_s=10) for m in metrics
    ]
    # Three replicas sweep at once: one removes the job, the others' transactions fail.
    removed = await asyncio.gather(*(s.sweep() for s in schedulers))
    assert sorted(removed) == [0, 0, 1]
    counted = [m.registry.get_sample_value("orchard_rollout_jobs_removed_total") for m in metrics]
    assert sorted(counted) == [0, 0, 1]
    assert await jobs.get(old.id) is None
    assert (await store.get_prefix(f"{GROUPS}{old.id}/")).kvs == []
    assert await store.get(REQUESTS + "req-old") is None
    assert [k.key_str for k in (await store.get_prefix("")).kvs if old.id in k.key_str] == [
        f"removed/{old.id}"
    ]
    assert await jobs.get(running.id) is not None
    assert await jobs.get(recent.id) is not None
    assert [i for i, _ in await jobs.groups(recent.id, 0)] == [0]

    # Get and StreamGroups of the removed job: NOT_FOUND saying it ended and was removed.
    manager = RolloutManager(config=RolloutConfig(), jobs=jobs, sandboxes=None)  # type: ignore[arg-type]
    with pytest.raises(OrchardError) as info:
        await manager.get(old.id)
    assert info.value.reason is RolloutReason.JOB_REMOVED
    assert info.value.reason.code == grpc.StatusCode.NOT_FOUND
    assert "ended (CANCELLED)" in info.value.message
    assert "retention of 10 s (jobs.retention_s)" in info.value.message
    streams = GroupStreams(jobs, JobEvents(store))
    with pytest.raises(OrchardError) as info:
        await anext(streams.stream(old.id, 0))
    assert info.value.reason is RolloutReason.JOB_REMOVED
    with pytest.raises(OrchardError) as info:
        await manager.get(new_job_id())
    assert info.value.reason is Reason.NOT_FOUND and "no rollout job" in info.value.message

    # The request id is free again; the note of the removal goes one retention later.
    again = await jobs.create(JobState(id=new_job_id(), spec=spec(), request_id="req-old"))
    assert again.id != old.id
    assert await schedulers[0].sweep(now=time.time() + 11) == 1  # `recent` by then
    assert await jobs.removed(old.id) is None
    assert await jobs.get(running.id) is not None


async def test_a_replica_removes_ended_jobs_on_its_own_and_zero_keeps_them(
    store: EtcdStore,
) -> None:
    jobs = JobStore(store)
    ended = JobState(id=new_job_id(), spec=spec(), state=api.ROLLOUT_JOB_STATE_FAILED)
    await jobs.put(ended)
    await jobs.emit(ended, group("g"))
    keep = JobScheduler(jobs, JobEvents(store), _Launcher(), RolloutMetrics(None), retention_s=0)
    assert await keep.sweep(now=time.time() + 10**9) == 0
    config = RolloutConfig(jobs={"retention_s": 1})
    assert config.jobs.sweep_interval_s == 1
    manager = RolloutManager(config=config, jobs=jobs, sandboxes=None)  # type: ignore[arg-type]
    await manager.open()
    try:
        await _until_async(lambda: _absent(jobs, ended.id), timeout_s=10)
        assert await jobs.removed(ended.id) is not None
    finally:
        await manager.close()
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        RolloutConfig(jobs={"retention_s": -1})


# -- listing ---------------------------------------------------------------------------------


async def test_pages_go_by_key_and_stay_put_while_jobs_come_and_go(store: EtcdStore) -> None:
    jobs = JobStore(store)
    manager = RolloutManager(config=RolloutConfig(), jobs=jobs, sandboxes=None)  # type: ignore[arg-type]
    first = []
    for _ in range(7):
        job = JobState(id=new_job_id(), spec=spec())
        await jobs.create(job)
        first.append(job.id)
    newest_first = list(reversed(first))
    page, token = await manager.list(3, "")
    assert [j.id for j in page] == newest_first[:3]
    assert token and decode_page_token(token) == newest_first[2]
    # Between pages: three new jobs and one of the next page removed.
    for _ in range(3):
        await jobs.create(JobState(id=new_job_id(), spec=spec()))
    gone = JobState(id=newest_first[4], spec=spec(), state=api.ROLLOUT_JOB_STATE_SUCCEEDED)
    await jobs.put(gone)
    stored = next(s for s in await jobs.stored() if s.job.id == gone.id)
    assert await jobs.remove(stored, 1)
    page, token = await manager.list(3, token)
    assert [j.id for j in page] == [newest_first[3], newest_first[5], newest_first[6]]
    assert token == ""  # the last page
    everything, token = await manager.list(0, "")
    assert len(everything) == 9 and token == ""
    assert [j.create_time for j in everything] == sorted(
        (j.create_time for j in everything), reverse=True
    )
    for bad in ("3", "not a token!", "azE6eHl6", first[0]):
        with pytest.raises(OrchardError) as info:
            await manager.list(3, bad)
        assert info.value.reason is Reason.INVALID_ARGUMENT, bad
        assert "not one this service gave" in info.value.message
    with pytest.raises(OrchardError, match="page_size must lie in"):
        await manager.list(1001, "")


# -- scheduler -------------------------------------------------------------------------------


class _Launcher:
    """What a claimed job runs: here a run that lasts until it is stopped, recorded."""

    def __init__(self) -> None:
        self.resumed: list[str] = []
        self.adopted = asyncio.Event()
        self.stopped: list[str] = []

    async def resume(self, job: JobState) -> Work | None:
        self.resumed.append(job.id)
        self.adopted.set()
        return self.run(job.id)

    async def run(self, job_id: str) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.stopped.append(job_id)
            raise


class Replica:
    """A scheduler with its own etcd client, lease and watch, as one service process has."""

    def __init__(self, endpoint: str, namespace: str, **options: Any) -> None:
        self.endpoint, self.namespace, self.options = endpoint, namespace, options
        self.launcher = _Launcher()
        self.metrics = RolloutMetrics(None)
        self.stack = AsyncExitStack()

    async def __aenter__(self) -> Replica:
        self.store = await self.stack.enter_async_context(
            EtcdStore(self.endpoint, namespace=self.namespace, timeout=2.0)
        )
        self.jobs = JobStore(self.store)
        self.events = JobEvents(self.store, self.metrics)
        await self.events.start()
        self.stack.push_async_callback(self.events.close)
        self.scheduler = JobScheduler(
            self.jobs, self.events, self.launcher, self.metrics, **self.options
        )
        await self.scheduler.open()
        self.stack.push_async_callback(self.scheduler.close)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stack.aclose()

    def metric(self, name: str) -> float:
        return self.metrics.registry.get_sample_value(f"orchard_rollout_{name}") or 0.0

    async def create(self) -> JobState:
        """As CreateRolloutJob does: the job and this replica's claim in one write."""
        job = JobState(id=new_job_id(), spec=spec())
        await self.jobs.create(job, owner=self.scheduler.owner, lease=self.scheduler.lease_id)
        self.scheduler.start(job.id, self.launcher.run(job.id))
        return job


async def test_a_stopped_replicas_job_is_adopted_at_once_and_a_dead_ones_after_its_lease(
    etcd: EmbeddedEtcd, namespace: str
) -> None:
    # No re-check for an hour: whatever happens here happens by the watch.
    options: dict[str, Any] = {"recheck_s": 3600, "lease_ttl_s": 2}
    async with Replica(etcd.endpoint, namespace, **options) as a:
        async with Replica(etcd.endpoint, namespace, **options) as b:
            job = await b.create()
            # Created and claimed at one revision: no replica's re-read can adopt it between.
            record, claim = await b.store.get(JOBS + job.id), await b.store.get(OWNERS + job.id)
            assert record is not None and claim is not None
            assert record.mod_revision == claim.mod_revision and claim.lease == b.scheduler.lease_id
            await a.scheduler.recheck()
            await asyncio.sleep(0.1)
            assert a.launcher.resumed == [] and b.scheduler.running == {job.id}
            assert b.metric("jobs_running") == 1
            started = time.monotonic()
        # b stopped (its lease revoked): a adopts the job as soon as etcd says so.
        async with asyncio.timeout(5):
            await a.launcher.adopted.wait()
        stopped_adoption_s = time.monotonic() - started
        assert a.launcher.resumed == [job.id] and a.scheduler.running == {job.id}
        assert a.metric("jobs_adopted_total") == 1 and a.metric("jobs_running") == 1
        assert stopped_adoption_s < 1.0, stopped_adoption_s

        # A replica that dies keeps its claim until its lease runs out (2 s), then loses it.
        c = Replica(etcd.endpoint, namespace, **options)
        await c.__aenter__()
        try:
            second = await c.create()
            a.launcher.adopted.clear()
            await c.events.close()
            await c.store.close()  # its keep-alive stops; nothing revokes the lease
            died = time.monotonic()
            async with asyncio.timeout(10):
                await a.launcher.adopted.wait()
            dead_adoption_s = time.monotonic() - died
            assert a.launcher.resumed == [job.id, second.id]
            assert dead_adoption_s < 2 + 1.5, dead_adoption_s
        finally:
            await c.stack.aclose()
        print(f"adoption after a stop: {stopped_adoption_s:.3f} s; after a death: "
              f"{dead_adoption_s:.3f} s (lease 2 s)")  # fmt: skip

        # A cancel written through another replica stops the run here at once.
        async with Replica(etcd.endpoint, namespace, **options) as d:
            cancelled = time.monotonic()
            await d.jobs.mark_cancelled(job.id)
            await _until(lambda: job.id not in a.scheduler.running)
            assert time.monotonic() - cancelled < 1.0
            assert a.launcher.stopped == [job.id]
            assert d.launcher.resumed == []  # never adopted twice


async def test_a_replica_that_lost_its_lease_takes_a_new_one_and_keeps_its_jobs(
    etcd: EmbeddedEtcd, namespace: str
) -> None:
    # What a busy machine did: the process missed its refreshes and etcd let the lease expire
    # (every claim on it went). Before, each later CreateRolloutJob failed INTERNAL for good.
    options: dict[str, Any] = {"recheck_s": 3600, "lease_ttl_s": 2}
    async with Replica(etcd.endpoint, namespace, **options) as a:
        running = await a.create()
        lost = a.scheduler.lease_id
        await a.store.revoke_lease(lost)  # what an expiry does: every key under it goes
        # Renewed (and its jobs claimed again) once the keep-alive finds the lease gone.
        await _until(lambda: a.metric("lease_renewals_total") == 1, timeout_s=10)
        assert a.scheduler.lease_id != lost
        # Its running job is claimed again on the new lease, and it still runs here.
        claim = await a.store.get(OWNERS + running.id)
        assert claim is not None and claim.lease == a.scheduler.lease_id
        assert claim.value_str == a.scheduler.owner and a.scheduler.running == {running.id}
        # New jobs are created on the new lease.
        later = await a.create()
        claim = await a.store.get(OWNERS + later.id)
        assert claim is not None and claim.lease == a.scheduler.lease_id
        assert a.launcher.stopped == []


async def test_a_job_another_replica_took_while_the_lease_was_lost_stops_here(
    etcd: EmbeddedEtcd, namespace: str
) -> None:
    options: dict[str, Any] = {"recheck_s": 3600, "lease_ttl_s": 2}
    async with Replica(etcd.endpoint, namespace, **options) as a:
        job = await a.create()
        async with Replica(etcd.endpoint, namespace, **options) as b:
            # a is stalled (a process too busy to run its lease loop): its lease goes and b
            # adopts the job (its claim vanished) before a takes a new lease.
            lease_loop = a.scheduler._loops[0]
            lease_loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lease_loop
            lost = a.scheduler.lease_id
            keepalive = a.scheduler._keepalive
            assert keepalive is not None
            await keepalive.stop()
            await a.store.revoke_lease(lost)
            async with asyncio.timeout(5):
                await b.launcher.adopted.wait()
            await a.scheduler.renew_lease(lost)
            assert a.scheduler.lease_id != lost
            await _until(lambda: job.id not in a.scheduler.running)
            assert a.launcher.stopped == [job.id] and b.scheduler.running == {job.id}
            claim = await b.store.get(OWNERS + job.id)
            assert claim is not None and claim.value_str == b.scheduler.owner


async def test_a_lease_found_lost_by_a_call_is_renewed_once(
    etcd: EmbeddedEtcd, namespace: str
) -> None:
    # CreateRolloutJob's path when the lease ran out before the keep-alive noticed: the write
    # fails on the lease, the service renews it (once, whoever asks) and writes again.
    async with Replica(etcd.endpoint, namespace, recheck_s=3600, lease_ttl_s=30) as a:
        lost = a.scheduler.lease_id
        keepalive = a.scheduler._keepalive
        assert keepalive is not None
        await keepalive.stop()  # expired in etcd, not yet noticed here
        await a.store.revoke_lease(lost)
        job = JobState(id=new_job_id(), spec=spec())
        with pytest.raises(LeaseNotFound):
            await a.jobs.create(job, owner=a.scheduler.owner, lease=lost)
        await a.scheduler.renew_lease(lost)
        await a.scheduler.renew_lease(lost)  # a second caller with the same lost lease: no-op
        assert a.metric("lease_renewals_total") == 1
        stored = await a.jobs.create(job, owner=a.scheduler.owner, lease=a.scheduler.lease_id)
        assert stored.id == job.id


# -- streams ---------------------------------------------------------------------------------


async def _stream_latencies(
    streams: GroupStreams, writer: JobStore, job: JobState, count: int
) -> list[float]:
    """Writes `count` groups with the writer and returns how long each took to reach the
    stream (time from before the write to its arrival)."""
    received: asyncio.Queue[tuple[int, float]] = asyncio.Queue()

    async def consume() -> None:
        async for message in streams.stream(job.id, 0):
            received.put_nowait((message.index, time.monotonic()))

    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0.2)  # the stream has read the store and waits
    latencies = []
    try:
        for i in range(count):
            sent = time.monotonic()
            await writer.emit(job, group(f"g{i}"))
            async with asyncio.timeout(5):
                index, at = await received.get()
            assert index == i
            latencies.append(at - sent)
            await asyncio.sleep(0.02)
        job.state = api.ROLLOUT_JOB_STATE_SUCCEEDED
        await writer.put_running(job)
        async with asyncio.timeout(5):
            await consumer  # the stream ends with the job
    finally:
        consumer.cancel()
    return latencies


async def test_a_group_written_by_another_replica_reaches_a_stream_without_polling(
    etcd: EmbeddedEtcd, namespace: str
) -> None:
    async with (
        EtcdStore(etcd.endpoint, namespace=namespace) as reader_store,
        EtcdStore(etcd.endpoint, namespace=namespace) as writer_store,
    ):
        events = JobEvents(reader_store)
        await events.start()
        try:
            # An hour between re-reads: a group that arrives came through the watch.
            streams = GroupStreams(JobStore(reader_store), events, recheck_s=3600)
            writer = JobStore(writer_store)
            job = JobState(id=new_job_id(), spec=spec())
            await writer.create(job)
            latencies = await _stream_latencies(streams, writer, job, 30)
        finally:
            await events.close()
    median, worst = statistics.median(latencies), max(latencies)
    print(f"write-to-stream latency over {len(latencies)} groups: median {median * 1000:.1f} ms, "
          f"max {worst * 1000:.1f} ms")  # fmt: skip
    assert worst < 0.5, latencies  # polling waited up to 2 s


async def test_the_watch_resumes_across_an_etcd_restart_and_relists_after_a_compaction(
    namespace: str,
) -> None:
    with EmbeddedEtcdCluster(1) as cluster:
        async with (
            EtcdStore(cluster.endpoints, namespace=namespace, timeout=2.0) as reader_store,
            EtcdStore(cluster.endpoints, namespace=namespace, timeout=2.0) as writer_store,
        ):
            metrics = RolloutMetrics(None)
            events = JobEvents(reader_store, metrics)
            await events.start()
            try:
                streams = GroupStreams(JobStore(reader_store), events, recheck_s=3600)
                writer = JobStore(writer_store)
                job = JobState(id=new_job_id(), spec=spec())
                await writer.create(job)
                got: list[int] = []

                async def consume() -> None:
                    async for message in streams.stream(job.id, 0):
                        got.append(message.index)

                consumer = asyncio.create_task(consume())
                try:
                    await writer.emit(job, group("before"))
                    await _until(lambda: got == [0])
                    cluster.kill_member(0)
                    await asyncio.sleep(0.5)
                    cluster.start_member(0)
                    await _retry(lambda: writer.emit(job, group("after")))
                    await _until(lambda: got == [0, 1], timeout_s=15)
                    resumed = metrics.registry.get_sample_value(
                        "orchard_rollout_job_watch_restarts_total", {"how": "resumed"}
                    )
                    assert resumed and resumed >= 1
                finally:
                    consumer.cancel()
            finally:
                await events.close()

            # A watch whose revision was compacted away reads everything again and goes on.
            late = JobEvents(writer_store, metrics)
            start = await writer_store.revision()
            await writer.emit(job, group("compacted"))
            await writer_store.compact(await writer_store.revision())
            await late.start(from_revision=start)
            try:
                woken = late.changed(job.id)
                await writer.emit(job, group("next"))
                async with asyncio.timeout(5):
                    await woken
                relisted = metrics.registry.get_sample_value(
                    "orchard_rollout_job_watch_restarts_total", {"how": "relisted"}
                )
                assert relisted == 1
            finally:
                await late.close()


async def _until(check: Any, timeout_s: float = 5) -> None:
    """Polls the test's own condition (what the code under test must do without polling)."""
    deadline = time.monotonic() + timeout_s
    for _ in iter(int, 1):
        if check():
            return
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def _until_async(check: Any, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    for _ in iter(int, 1):
        if await check():
            return
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def _absent(jobs: JobStore, job_id: str) -> bool:
    return await jobs.get(job_id) is None


async def _retry(call: Any, timeout_s: float = 15) -> None:
    """Calls until etcd (restarting) takes it."""
    from orchard.core.etcd import EtcdError

    async with asyncio.timeout(timeout_s):
        while True:
            try:
                await call()
                return
            except EtcdError:
                await asyncio.sleep(0.1)
