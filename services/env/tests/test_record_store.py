"""The record store: binary records (and the earlier JSON ones), reads served from the watch's
view, state counts kept from deltas, and a resync after the watch's history was compacted.
Real etcd, real servers, real agents (the unisolated runtime double, see ``conftest.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from orchard.core.etcd import EmbeddedEtcd, EtcdStore
from orchard.env.metrics import EnvMetrics
from orchard.env.record_store import RecordStore
from orchard.env.records import (
    OwnerRecord,
    SandboxRecord,
    owner_key,
    request_key,
    sandbox_key,
)
from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api

PENDING = env_pb2.SANDBOX_STATE_PENDING
READY = env_pb2.SANDBOX_STATE_READY
FAILED = env_pb2.SANDBOX_STATE_FAILED
DELETING = env_pb2.SANDBOX_STATE_DELETING
STATES = {"PENDING": PENDING, "READY": READY, "FAILED": FAILED, "DELETING": DELETING}


def json_sandbox_record(record: SandboxRecord) -> bytes:
    """A record as orchard-env wrote it before records were binary (the JSON envelope)."""
    sandbox = env_pb2.Sandbox()
    sandbox.CopyFrom(record.sandbox)
    sandbox.ClearField("expire_time")
    envelope: dict[str, Any] = {
        "sandbox": json_format.MessageToDict(sandbox),
        "agent_address": record.agent_address,
    }
    if record.request_key:
        envelope["request_key"] = record.request_key
    if record.queued:
        envelope["queued"] = True
        envelope["queue_round"] = record.queue_round
    if record.slots:
        envelope["slots"] = list(record.slots)
    return json.dumps(envelope, separators=(",", ":"), sort_keys=True).encode()


def json_owner_record(owner: env_pb2.Owner) -> bytes:
    return json_format.MessageToJson(owner, indent=None, sort_keys=True).encode()


def sample_record(**fields: Any) -> SandboxRecord:
    sandbox = env_pb2.Sandbox(
        id="sbx-0123456789ab",
        tenant="alpha",
        state=READY,
        runtime="unisolated-test",
        spec=env_pb2.SandboxSpec(image="host", labels={"task": "t1"}, env={"K": "sealed:v1:x"}),
    )
    sandbox.create_time.FromSeconds(1_700_000_000)
    sandbox.expire_time.FromSeconds(1_700_000_100)
    return SandboxRecord(sandbox, agent_address="unix:/run/a.sock", **fields)


def test_records_are_binary_and_the_earlier_json_form_still_reads() -> None:
    record = sample_record(request_key="requests/alpha/abc", slots=("slots/all/3",))
    stored = record.encode()
    assert not stored.startswith(b"{") and b"sbx-0123456789ab" in stored
    back = SandboxRecord.decode(stored, mod_revision=7, lease=9)
    assert back.mod_revision == 7 and back.lease == 9
    assert back.sandbox.spec == record.sandbox.spec and back.slots == record.slots
    assert not back.sandbox.HasField("expire_time")  # the lease's TTL, never stored
    assert (back.agent_address, back.request_key) == (record.agent_address, record.request_key)
    # What an earlier version wrote decodes to the same record.
    old = SandboxRecord.decode(json_sandbox_record(record), mod_revision=7, lease=9)
    assert old == back
    queued = sample_record(queued=True, queue_round=4)
    assert SandboxRecord.decode(json_sandbox_record(queued)) == SandboxRecord.decode(
        queued.encode()
    )
    # Owners the same way.
    owner = env_pb2.Owner(id="own-1", tenant="alpha", labels={"job": "j"})
    owner.heartbeat_timeout.FromSeconds(30)
    binary = OwnerRecord(owner).encode()
    assert not binary.startswith(b"{")
    assert OwnerRecord.decode(binary).owner == owner
    assert OwnerRecord.decode(json_owner_record(owner)).owner == owner


async def test_a_deployment_upgrades_in_place_from_json_records(env_factory: Any) -> None:
    """Records and owners an earlier version left in etcd are served, and a record rewritten
    by this version is binary."""
    env = await env_factory()
    store = env.app.store
    # An owner and a PENDING record (no replica creating it) in the old form, as a replica of
    # the earlier version would have left them.
    owner = env_pb2.Owner(id="own-0000000000aa", tenant="alpha", labels={"job": "old"})
    owner.heartbeat_timeout.FromSeconds(30)
    owner_lease = await store.grant_lease(30)
    await store.put(owner_key("alpha", owner.id), json_owner_record(owner), lease=owner_lease)
    sandbox = env_pb2.Sandbox(
        id="sbx-0000000000aa",
        tenant="alpha",
        state=PENDING,
        runtime="unisolated-test",
        spec=env_pb2.SandboxSpec(image="host", labels={"from": "json"}),
    )
    sandbox.create_time.GetCurrentTime()
    rkey = request_key("alpha", "old-request")
    old = SandboxRecord(sandbox, request_key=rkey)
    lease = await store.grant_lease(30)
    await store.put(sandbox_key("alpha", sandbox.id), json_sandbox_record(old), lease=lease)
    await store.put(rkey, sandbox.id, lease=lease)

    # A new sandbox joins the old owner (its record is read to find the owner's lease).
    member = await env.ready(owner_id=owner.id)
    member_kv = await store.get(sandbox_key("alpha", member.id))
    assert member_kv is not None and member_kv.lease == owner_lease.id
    # Reconcile takes the orphaned PENDING record over and makes it READY.
    await env.app.controller.reconcile()
    ready = await env.wait(sandbox.id, timeout_s=20)
    assert ready.state == READY and ready.spec.labels == {"from": "json"}
    kv = await store.get(sandbox_key("alpha", sandbox.id))
    assert kv is not None and not kv.value.startswith(b"{")
    assert SandboxRecord.from_kv(kv).request_key == rkey
    # A retry of the old request finds the same sandbox.
    retry = await env.stub.CreateSandbox(
        api.CreateSandboxRequest(spec=sandbox.spec, request_id="old-request"), metadata=env.md()
    )
    assert retry.sandbox.id == sandbox.id


def count_etcd_calls(store: EtcdStore) -> Counter[str]:
    """Count the unary etcd calls a store makes from now on (watches are streams, not
    counted), by ``service.Method``."""
    calls: Counter[str] = Counter()
    unary = store._unary

    async def counted(service: str, method: str, request: Any) -> Any:
        calls[f"{service}.{method}"] += 1
        return await unary(service, method, request)

    store._unary = counted  # type: ignore[method-assign]
    return calls


async def test_wait_and_get_read_no_etcd(env: Any) -> None:
    calls = count_etcd_calls(env.app.controller.store)
    created = [await env.create() for _ in range(3)]
    for sandbox in created:
        assert (await env.wait(sandbox.id)).state == READY
    # Waits right after the create, and the creation itself, read no record from etcd: the
    # view had each record from its insert on.
    assert calls["kv.Range"] == 0, calls
    calls.clear()
    for _ in range(5):
        for sandbox in created:
            got = await env.stub.GetSandbox(
                api.GetSandboxRequest(sandbox_id=sandbox.id), metadata=env.md()
            )
            assert got.sandbox.state == READY and got.sandbox.expire_time.seconds > time.time()
            assert (await env.wait(sandbox.id)).state == READY
    assert sum(calls.values()) == 0, calls
    # A sandbox nobody has is still NOT_FOUND (read from etcd, the view may only lag).
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.stub.GetSandbox(api.GetSandboxRequest(sandbox_id="sbx-nope"), metadata=env.md())
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert calls["kv.Range"] == 1


def gauge_counts(env: Any) -> dict[int, int]:
    gauge = env.app.controller.metrics.sandboxes
    return {value: int(gauge.labels(state=name)._value.get()) for name, value in STATES.items()}


async def etcd_counts(env: Any) -> dict[int, int]:
    listing = await env.app.store.get_prefix("sandboxes/")
    found = Counter(SandboxRecord.from_kv(kv).state for kv in listing.kvs)
    return {value: found.get(value, 0) for value in STATES.values()}


async def settled_counts(env: Any, within: float = 10) -> dict[int, int]:
    """The gauge once it agrees with etcd (the watch delivers changes a moment later)."""
    deadline = time.monotonic() + within
    while True:
        want = await etcd_counts(env)
        if gauge_counts(env) == want:
            return want
        assert time.monotonic() < deadline, (gauge_counts(env), want)
        await asyncio.sleep(0.05)


async def test_state_counts_follow_bursts_of_creates_failures_and_deletes(
    env_factory: Any, runtime: Any
) -> None:
    runtime.fail_images.add("rootfs:/broken")
    a, b = await env_factory(), await env_factory()  # b only watches: its counts move too
    good = await asyncio.gather(*(a.create() for _ in range(12)))
    bad = await asyncio.gather(*(a.create(image="rootfs:/broken") for _ in range(6)))
    await asyncio.gather(*(a.wait(s.id) for s in [*good, *bad]))
    counts = await settled_counts(a)
    assert counts[READY] == 12 and counts[FAILED] == 6 and counts[PENDING] == 0
    assert await settled_counts(b) == counts
    await asyncio.gather(
        *(a.stub.DeleteSandbox(api.DeleteSandboxRequest(sandbox_id=s.id), metadata=a.md())
          for s in [*good[:7], *bad[:4]])
    )  # fmt: skip
    more = await asyncio.gather(*(b.create() for _ in range(5)))
    await asyncio.gather(*(b.wait(s.id) for s in more))
    counts = await settled_counts(a)
    assert counts == {PENDING: 0, READY: 12 - 7 + 5, FAILED: 6 - 4, DELETING: 0}
    assert await settled_counts(b) == counts


class TcpRelay:
    """Relays TCP to etcd so a test can cut a client off from it and let it back."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()
        self._server = None

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}


class Heard:
    """What the record store tells the controller, kept for the test to look at."""

    def __init__(self) -> None:
        self.resyncs = 0
        self.deleted: list[str] = []
        self.changes: list[tuple[str, int | None, int]] = []  # id, state before, state after

    def record_changed(self, record: SandboxRecord, previous: SandboxRecord | None) -> None:
        self.changes.append((record.id, previous.state if previous else None, record.state))

    def record_deleted(self, previous: SandboxRecord | None, tenant: str, sandbox_id: str) -> None:
        self.deleted.append(sandbox_id)

    def creating_deleted(self, tenant: str, sandbox_id: str, replica: str) -> None:
        pass

    def slot_released(self) -> None:
        pass

    def resynced(self) -> None:
        self.resyncs += 1


@pytest.fixture
async def own_etcd() -> AsyncIterator[EmbeddedEtcd]:
    """An etcd of this test's own: it compacts history, which the session's etcd must not."""
    async with EmbeddedEtcd() as server:
        yield server


async def test_view_and_counts_resync_after_the_watch_history_was_compacted(
    own_etcd: EmbeddedEtcd,
) -> None:
    relay = TcpRelay(int(own_etcd.endpoint.rsplit(":", 1)[1]))
    await relay.open()
    heard = Heard()
    metrics = EnvMetrics(None)
    async with (
        EtcdStore(own_etcd.endpoint, namespace="env/") as direct,
        EtcdStore(f"http://127.0.0.1:{relay.port}", namespace="env/", timeout=1) as relayed,
    ):
        records = RecordStore(relayed, metrics, heard)
        await records.start()
        try:

            def put(sandbox_id: str, state: int) -> Any:
                sandbox = env_pb2.Sandbox(id=sandbox_id, tenant="t", state=state)
                return direct.put(sandbox_key("t", sandbox_id), SandboxRecord(sandbox).encode())

            for n, state in enumerate((READY, READY, PENDING, FAILED)):
                await put(f"sbx-{n}", state)
            await until(lambda: len(records.view.records) == 4)
            assert records.states.counts[READY] == 2
            waiter = records.view.changed(sandbox_key("t", "sbx-2"))
            await relay.cut()
            # While the view is cut off: changes, then the history it would resume from goes.
            await direct.delete(sandbox_key("t", "sbx-0"))
            await put("sbx-2", READY)
            await put("sbx-4", FAILED)
            await direct.compact(await direct.revision())
            await relay.open()
            await until(lambda: heard.resyncs >= 2, within=20)  # the first load, then this one
            assert waiter.done()
            assert sorted(records.view.by_id) == ["sbx-1", "sbx-2", "sbx-3", "sbx-4"]
            assert records.view.records[sandbox_key("t", "sbx-2")].state == READY
            assert records.states.counts == {PENDING: 0, READY: 2, FAILED: 2, DELETING: 0}
            assert metrics.sandboxes.labels(state="FAILED")._value.get() == 2
            # And it follows changes again from there.
            await direct.delete(sandbox_key("t", "sbx-4"))
            await until(lambda: "sbx-4" in heard.deleted)
            assert records.states.counts[FAILED] == 1
        finally:
            await records.close()
            await relay.cut()


async def test_events_older_than_a_write_this_replica_offered_change_nothing(
    own_etcd: EmbeddedEtcd,
) -> None:
    """A write this replica made is in its view at once; the watch's events for it, and for
    older revisions of the key, arrive later and must not turn the view back."""
    relay = TcpRelay(int(own_etcd.endpoint.rsplit(":", 1)[1]))
    await relay.open()
    heard = Heard()
    async with (
        EtcdStore(own_etcd.endpoint, namespace="env/") as direct,
        EtcdStore(f"http://127.0.0.1:{relay.port}", namespace="env/", timeout=1) as relayed,
    ):
        records = RecordStore(relayed, EnvMetrics(None), heard)
        await records.start()
        try:
            await relay.cut()  # the watch falls behind
            sandbox = env_pb2.Sandbox(id="sbx-1", tenant="t", state=PENDING)
            key = sandbox_key("t", "sbx-1")
            await direct.put(key, SandboxRecord(sandbox).encode())
            sandbox.state = READY
            ready = SandboxRecord(sandbox)
            ready.mod_revision = await direct.put(key, ready.encode())
            records.offer(ready)
            assert records.view.records[key].state == READY
            assert heard.changes == [("sbx-1", None, READY)]
            await relay.open()  # the watch resumes and delivers both puts
            await records.view.reached(ready.mod_revision)
            assert records.view.records[key].state == READY
            assert heard.changes == [("sbx-1", None, READY)]
            assert records.states.counts[READY] == 1 and records.states.counts[PENDING] == 0
        finally:
            await records.close()
            await relay.cut()


async def until(predicate: Any, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_one_request_id_helper_serves_create_fork_and_owners(env_factory: Any) -> None:
    """Create, fork and create-owner share one de-duplication: a retry on the same replica is
    answered from the view, one on another replica (whose view may lag) from etcd."""
    a, b = await env_factory(), await env_factory()
    spec = env_pb2.SandboxSpec(image="host")
    first = await a.stub.CreateSandbox(
        api.CreateSandboxRequest(spec=spec, request_id="r-1"), metadata=a.md()
    )
    calls = count_etcd_calls(a.app.controller.store)
    again = await a.stub.CreateSandbox(
        api.CreateSandboxRequest(spec=spec, request_id="r-1"), metadata=a.md()
    )
    assert again.sandbox.id == first.sandbox.id and sum(calls.values()) == 0, calls
    elsewhere = await b.stub.CreateSandbox(
        api.CreateSandboxRequest(spec=spec, request_id="r-1"), metadata=b.md()
    )
    assert elsewhere.sandbox.id == first.sandbox.id
    await a.wait(first.sandbox.id)
    fork = api.ForkSandboxRequest(sandbox_id=first.sandbox.id, count=2, request_id="f-1")
    forks = [
        sorted(s.id for s in (await env.stub.ForkSandbox(fork, metadata=env.md())).sandboxes)
        for env in (a, a, b)
    ]
    assert forks[0] == forks[1] == forks[2] and len(forks[0]) == 2
    owner = api.CreateOwnerRequest(request_id="o-1")
    owner.heartbeat_timeout.FromSeconds(30)
    owners = {(await env.stub.CreateOwner(owner, metadata=env.md())).owner.id for env in (a, b)}
    assert len(owners) == 1
    listing = await a.app.store.get_prefix("sandboxes/")
    assert len(listing.kvs) == 3  # one creation, two forks: nothing made twice
