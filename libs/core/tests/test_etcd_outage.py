"""EtcdStore when etcd goes away: typed, retryable errors in bounded time, and failover."""

from __future__ import annotations

import asyncio

import pytest

from orchard.core.etcd import EmbeddedEtcd, EtcdStore, EtcdUnavailable


async def test_killed_etcd_makes_calls_raise_unavailable() -> None:
    async with EmbeddedEtcd() as etcd, EtcdStore(etcd.endpoint, timeout=1.0) as store:
        lease = await store.grant_lease(5)
        keepalive = store.keep_alive(lease, interval=0.05)
        async with store.watch_prefix("") as watch:
            await store.put("before", "x")
            assert (await anext(watch)).key == b"before"
            etcd.kill()
            async with asyncio.timeout(5):
                with pytest.raises(EtcdUnavailable):
                    await anext(watch)
                with pytest.raises(EtcdUnavailable):
                    await store.get("before")
                with pytest.raises(EtcdUnavailable):
                    await store.put("after", "x")
                with pytest.raises(EtcdUnavailable):
                    await store.txn([], [])
                with pytest.raises(EtcdUnavailable):
                    await store.refresh_lease(lease)
                with pytest.raises(EtcdUnavailable):
                    await store.grant_lease(5)
                with pytest.raises(EtcdUnavailable):
                    async with store.watch_prefix(""):
                        pass
            # The keep-alive rides out the outage, retrying, instead of dying.
            await asyncio.sleep(0.2)
            assert keepalive.error is None
            assert keepalive.running


async def test_connect_to_nothing_raises_unavailable() -> None:
    async with EmbeddedEtcd() as etcd:
        endpoint = etcd.endpoint
    store = EtcdStore(endpoint, connect_timeout=0.5)
    async with asyncio.timeout(5):
        with pytest.raises(EtcdUnavailable, match=endpoint):
            await store.connect()


async def test_fails_over_to_the_next_endpoint() -> None:
    # Two independent servers stand in for two members: enough to see the switch.
    async with EmbeddedEtcd() as first, EmbeddedEtcd() as second:
        async with EtcdStore([first.endpoint, second.endpoint], timeout=1.0) as store:
            assert store.endpoint == first.endpoint
            first.kill()
            with pytest.raises(EtcdUnavailable):
                await store.put("k", "v")
            assert store.endpoint == second.endpoint
            await store.put("k", "v")
        async with EtcdStore([first.endpoint, second.endpoint]) as store:
            assert store.endpoint == second.endpoint
