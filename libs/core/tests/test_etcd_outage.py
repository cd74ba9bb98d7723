"""EtcdStore when etcd goes away: typed, retryable errors in bounded time, and failover."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
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


async def test_calls_cut_off_by_a_failover_raise_unavailable_not_cancelled() -> None:
    # Moving to the next endpoint closes the old channel, and grpc.aio ends the calls still
    # in flight on it with CancelledError: the caller's task was not cancelled, so the store
    # must raise its retryable error (a CancelledError would end the caller's task silently).
    async with (
        EmbeddedEtcd() as first,
        EmbeddedEtcd() as second,
        EtcdStore([first.endpoint, second.endpoint], timeout=5.0) as store,
    ):
        await store.put("k", "v" * 10_000)
        calls = [asyncio.create_task(store.get("k")) for _ in range(200)]
        await asyncio.sleep(0)
        store.report_unavailable(store.current())
        results = await asyncio.gather(*calls, return_exceptions=True)
        cut = [r for r in results if isinstance(r, BaseException)]
        assert cut, "no call was in flight at the switch; the test proves nothing"
        assert all(isinstance(r, EtcdUnavailable) for r in cut), {type(r) for r in cut}
        assert store.endpoint == second.endpoint


async def test_a_cancelled_caller_still_sees_cancelled() -> None:
    async with EmbeddedEtcd() as etcd, EtcdStore(etcd.endpoint) as store:
        call = asyncio.create_task(store.get("k"))
        await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call


async def test_a_watch_that_is_never_confirmed_times_out() -> None:
    # A member that serves gRPC but does not confirm the watch (etcd restarting, before it
    # rejoined its cluster) held a watch's creation, and with it every waiter, forever.
    async def silent_watch(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await asyncio.sleep(3600)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "etcdserverpb.Watch", {"Watch": grpc.stream_stream_rpc_method_handler(silent_watch)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        async with EmbeddedEtcd() as etcd, EtcdStore([etcd.endpoint, endpoint], timeout=1.0) as s:
            s.report_unavailable(s.current())
            assert s.endpoint == endpoint
            async with asyncio.timeout(5):
                with pytest.raises(EtcdUnavailable):
                    async with s.watch_prefix(""):
                        pass
            assert s.endpoint == etcd.endpoint  # and the store moved on
    finally:
        await server.stop(0)
