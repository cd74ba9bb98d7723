"""EtcdStore against a real etcd: keys, paging, transactions, leases, watches."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from orchard.core.etcd import (
    CompactedRevision,
    Compare,
    CompareOp,
    DeleteOp,
    DeleteResult,
    EmbeddedEtcd,
    EtcdClosed,
    EtcdError,
    EtcdStore,
    EventType,
    GetOp,
    LeaseNotFound,
    PutOp,
    RangeResult,
    SortOrder,
    SortTarget,
)


@pytest.fixture
async def store(etcd: EmbeddedEtcd) -> AsyncIterator[EtcdStore]:
    """A store in a namespace of its own, emptied afterwards."""
    async with EtcdStore(etcd.endpoint, namespace=f"test/{uuid.uuid4().hex}/") as store:
        yield store
        await store.delete_prefix(b"")


async def test_put_get_delete(store: EtcdStore) -> None:
    assert await store.get("missing") is None
    first = await store.put("a", "1")
    second = await store.put(b"a", b"2")
    assert second > first
    kv = await store.get("a")
    assert kv is not None
    assert (kv.key, kv.value, kv.value_str) == (b"a", b"2", "2")
    assert (kv.create_revision, kv.mod_revision, kv.version, kv.lease) == (first, second, 2, 0)
    old = await store.get("a", revision=first)
    assert old is not None and old.value == b"1"
    assert await store.delete("a") is True
    assert await store.delete("a") is False
    assert await store.get("a") is None


async def test_namespace_isolates_stores(etcd: EmbeddedEtcd, store: EtcdStore) -> None:
    await store.put("k", "mine")
    async with EtcdStore(etcd.endpoint, namespace=store.namespace + b"other/") as inner:
        assert await inner.get("k") is None
        await inner.put("k", "inner")
    listed = await store.get_prefix("")
    assert [kv.key for kv in listed.kvs] == [b"k", b"other/k"]


async def test_prefix_listing_paging_and_sort(store: EtcdStore) -> None:
    for i in range(7):
        await store.put(f"items/{i:02d}", f"v{6 - i}")
    await store.put("itemsX", "outside the prefix")

    everything = await store.get_prefix("items/")
    assert [kv.key_str for kv in everything.kvs] == [f"items/{i:02d}" for i in range(7)]
    assert (everything.count, everything.more) == (7, False)

    page = await store.get_prefix("items/", limit=3)
    assert [kv.key_str for kv in page.kvs] == ["items/00", "items/01", "items/02"]
    assert (page.count, page.more) == (7, True)
    # A write between pages is not seen when paging at the first page's revision.
    await store.put("items/99", "late")
    rest = await store.get_prefix(
        "items/", limit=10, start_after=page.kvs[-1].key, revision=page.revision
    )
    assert [kv.key_str for kv in rest.kvs] == [f"items/{i:02d}" for i in range(3, 7)]
    assert rest.more is False

    paged = [kv.key_str async for kv in store.iter_prefix("items/", page_size=2)]
    assert paged == [f"items/{i:02d}" for i in range(7)] + ["items/99"]
    listed = await store.list_prefix("items/", page_size=3)
    assert [kv.key_str for kv in listed.kvs] == paged

    by_value = await store.get_prefix(
        "items/", sort_target=SortTarget.VALUE, sort_order=SortOrder.DESCEND, limit=2
    )
    assert [kv.value_str for kv in by_value.kvs] == ["v6", "v5"]
    keys_only = await store.range("items/00", "items/02", keys_only=True)
    assert [(kv.key, kv.value) for kv in keys_only.kvs] == [(b"items/00", b""), (b"items/01", b"")]

    assert await store.delete_prefix("items/") == 8
    assert (await store.get_prefix("items")).count == 1


async def test_compare_and_swap_helpers(store: EtcdStore) -> None:
    created = await store.create_if_absent("cas", "one")
    assert created is not None
    assert await store.create_if_absent("cas", "two") is None

    updated = await store.put_if_mod_revision("cas", "two", created)
    assert updated is not None and updated > created
    assert await store.put_if_mod_revision("cas", "stale", created) is None
    kv = await store.get("cas")
    assert kv is not None and kv.value == b"two"

    assert await store.delete_if_mod_revision("cas", created) is False
    assert await store.delete_if_mod_revision("cas", updated) is True
    assert await store.get("cas") is None
    assert await store.put_if_mod_revision("cas", "again", 0) is not None


async def test_general_txn_branches(store: EtcdStore) -> None:
    await store.put("txn/a", "1")
    await store.put("txn/b", "2")
    result = await store.txn(
        [
            Compare.value("txn/a", CompareOp.EQUAL, "1"),
            Compare.version("txn/b", CompareOp.GREATER, 0),
        ],
        success=[PutOp.of("txn/c", "3"), DeleteOp.of("txn/a"), GetOp.of("txn/", prefix=True)],
        failure=[PutOp.of("txn/failed", "x")],
    )
    assert result.succeeded
    assert result.results[1] == DeleteResult(deleted=1)
    listing = result.results[2]
    assert isinstance(listing, RangeResult)
    assert [kv.key for kv in listing.kvs] == [b"txn/b", b"txn/c"]

    result = await store.txn(
        [Compare.value("txn/a", CompareOp.EQUAL, "1")],
        success=[PutOp.of("txn/never", "x")],
        failure=[DeleteOp.of("txn/", prefix=True)],
    )
    assert not result.succeeded
    assert result.results == [DeleteResult(deleted=2)]
    assert (await store.get_prefix("txn/")).count == 0


async def test_lease_expires_without_keep_alive_and_survives_with_it(store: EtcdStore) -> None:
    kept, dropped = await store.grant_lease(1), await store.grant_lease(1)
    await store.put("lease/kept", "x", lease=kept)
    await store.put("lease/dropped", "x", lease=dropped.id)
    keepalive = store.keep_alive(kept)
    assert keepalive.interval == pytest.approx(1 / 3)

    async with store.watch_prefix("lease/") as watch, asyncio.timeout(5):
        expired = await anext(watch)
    assert (expired.type, expired.key) == (EventType.DELETE, b"lease/dropped")
    await asyncio.sleep(1.2)  # past the kept lease's TTL once more
    kv = await store.get("lease/kept")
    assert kv is not None and kv.lease == kept.id
    assert keepalive.running and keepalive.error is None
    assert await store.lease_time_to_live(dropped) is None
    info = await store.lease_time_to_live(kept, keys=True)
    assert info is not None and info.keys == [b"lease/kept"] and info.granted_ttl == 1

    with pytest.raises(LeaseNotFound):
        await store.put("lease/late", "x", lease=dropped)
    with pytest.raises(LeaseNotFound):
        await store.refresh_lease(dropped)
    await keepalive.stop()
    assert not keepalive.running


async def test_revoke_deletes_keys_and_stops_keep_alive(store: EtcdStore) -> None:
    lease = await store.grant_lease(10)
    await store.put("revoke/a", "x", lease=lease)
    await store.put("revoke/b", "x", lease=lease)
    assert await store.refresh_lease(lease) == 10
    keepalive = store.keep_alive(lease)
    await store.revoke_lease(lease)
    assert not keepalive.running
    assert (await store.get_prefix("revoke/")).count == 0
    with pytest.raises(LeaseNotFound):
        await store.revoke_lease(lease)


async def test_keep_alive_reports_a_lost_lease(store: EtcdStore) -> None:
    lease = await store.grant_lease(10)
    keepalive = store.keep_alive(lease, interval=0.05)
    # Revoked behind the keep-alive's back (another replica, an operator): it must notice.
    async with EtcdStore(store.endpoint) as other:
        await other.revoke_lease(lease)
    async with asyncio.timeout(2):
        with pytest.raises(LeaseNotFound):
            await keepalive.wait()
    assert isinstance(keepalive.error, LeaseNotFound)


async def test_watch_sees_puts_and_deletes_in_order(store: EtcdStore) -> None:
    async with store.watch_prefix("w/", prev_kv=True) as watch:
        r1 = await store.put("w/a", "1")
        r2 = await store.put("w/a", "2")
        await store.put("elsewhere", "ignored")
        r3 = await store.delete("w/a")
        events = [await anext(watch) for _ in range(3)]
    assert r3
    assert [(e.type, e.key, e.value) for e in events] == [
        (EventType.PUT, b"w/a", b"1"),
        (EventType.PUT, b"w/a", b"2"),
        (EventType.DELETE, b"w/a", b""),
    ]
    assert [e.mod_revision for e in events[:2]] == [r1, r2]
    assert events[0].prev_kv is None
    assert events[1].prev_kv is not None and events[1].prev_kv.value == b"1"
    assert events[2].prev_kv is not None and events[2].prev_kv.value == b"2"
    assert watch.next_revision == events[2].mod_revision + 1
    # A closed watch ends iteration instead of hanging.
    assert [e async for e in watch] == []


async def test_watch_resumes_from_an_earlier_revision(store: EtcdStore) -> None:
    async with store.watch_prefix("r/") as watch:
        await store.put("r/1", "a")
        first = await anext(watch)
    resume_from = watch.next_revision
    # Missed while nobody watched:
    await store.put("r/2", "b")
    await store.delete("r/1")
    async with store.watch_prefix("r/", start_revision=resume_from) as resumed:
        await store.put("r/3", "c")
        replayed = [await anext(resumed) for _ in range(3)]
    assert first.key == b"r/1"
    assert [(e.type, e.key) for e in replayed] == [
        (EventType.PUT, b"r/2"),
        (EventType.DELETE, b"r/1"),
        (EventType.PUT, b"r/3"),
    ]


async def test_single_key_watch(store: EtcdStore) -> None:
    async with store.watch("one") as watch:
        await store.put("one-more", "no")
        await store.put("one", "yes")
        event = await anext(watch)
    assert (event.key, event.value) == (b"one", b"yes")


async def test_list_and_watch_has_no_gap(store: EtcdStore) -> None:
    await store.put("lw/a", "1")
    await store.put("lw/b", "2")
    async with store.list_and_watch("lw/", page_size=1) as (snapshot, watch):
        assert [kv.key for kv in snapshot.kvs] == [b"lw/a", b"lw/b"]
        await store.put("lw/c", "3")
        event = await anext(watch)
    assert event.key == b"lw/c" and event.mod_revision == snapshot.revision + 1


async def test_compacted_revision_raises_typed_error() -> None:
    # Compaction is etcd-wide, so this test gets a server of its own.
    with EmbeddedEtcd() as etcd:
        async with EtcdStore(etcd.endpoint) as store:
            early = await store.put("c", "1")
            await store.put("c", "2")
            latest = await store.put("c", "3")
            await store.compact(latest)
            with pytest.raises(CompactedRevision) as info:
                async with store.watch_prefix("c", start_revision=early) as watch:
                    async with asyncio.timeout(2):
                        await anext(watch)
            assert info.value.compact_revision == latest
            with pytest.raises(CompactedRevision):
                await store.get("c", revision=early)
            async with store.list_and_watch("c") as (snapshot, _):
                assert snapshot.revision == latest


async def test_closed_store_raises(etcd: EmbeddedEtcd) -> None:
    store = EtcdStore(etcd.endpoint)
    with pytest.raises(EtcdClosed):
        await store.get("x")
    async with store:
        await store.put("closed-test", "x")
        await store.delete("closed-test")
    with pytest.raises(EtcdClosed):
        await store.get("x")


async def test_iterating_an_unstarted_watch_says_how_to_start_it(etcd: EmbeddedEtcd) -> None:
    async with EtcdStore(etcd.endpoint, namespace="unstarted-watch/") as store:
        watch = store.watch_prefix("")
        with pytest.raises(EtcdError, match="watch not started"):
            await anext(watch)
