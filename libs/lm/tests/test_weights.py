"""The weight-version registry on a real etcd: publish, read, follow; numbers stay consecutive
under concurrent publishers and a retried publish is harmless."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from orchard.core.etcd import EtcdStore
from orchard.lm.weights import (
    InvalidWeightVersion,
    WeightRegistry,
    WeightVersionConflict,
)


@pytest.fixture
async def store(etcd):
    async with EtcdStore(etcd.endpoint, namespace=f"test/{uuid.uuid4().hex}/") as store:
        yield store
        await store.delete_prefix("")


async def test_publish_then_read(store):
    registry = WeightRegistry(store, "policy")
    assert await registry.latest() is None
    assert await registry.get("step-1") is None
    first = await registry.publish("step-1", "file:///models/step-1", {"step": "1"})
    second = await registry.publish("step-2", "file:///models/step-2")
    assert (first.number, second.number) == (1, 2)
    assert await registry.latest() == second
    assert await registry.get("step-1") == first
    assert first.metadata == {"step": "1"}
    assert [v.version for v in await registry.versions()] == ["step-1", "step-2"]
    # Another model in the same store has its own versions.
    assert await WeightRegistry(store, "critic").latest() is None


async def test_republish_is_idempotent_and_a_moved_location_is_refused(store):
    registry = WeightRegistry(store)
    first = await registry.publish("v1", "file:///a")
    assert await registry.publish("v1", "file:///a") == first
    with pytest.raises(WeightVersionConflict, match="already published at 'file:///a'"):
        await registry.publish("v1", "file:///b")
    assert (await registry.latest()) == first


async def test_concurrent_publishers_get_consecutive_numbers(store):
    registry = WeightRegistry(store)
    published = await asyncio.gather(
        *(registry.publish(f"v{k}", f"file:///m/{k}") for k in range(8))
    )
    assert sorted(v.number for v in published) == list(range(1, 9))
    latest = await registry.latest()
    assert latest is not None and latest.number == 8
    assert latest == max(published, key=lambda v: v.number)


async def test_watch_yields_the_latest_then_each_new_version(store):
    registry = WeightRegistry(store)
    await registry.publish("v1", "file:///m/1")
    seen = []
    async with registry.watch() as updates:
        iterator = aiter(updates)
        seen.append(await anext(iterator))
        await registry.publish("v2", "file:///m/2")
        await registry.publish("v3", "file:///m/3")
        seen.append(await asyncio.wait_for(anext(iterator), 5))
        seen.append(await asyncio.wait_for(anext(iterator), 5))
    assert [(v.version, v.number) for v in seen] == [("v1", 1), ("v2", 2), ("v3", 3)]


async def test_watch_before_any_version(store):
    registry = WeightRegistry(store)
    async with registry.watch() as updates:
        iterator = aiter(updates)
        waiting = asyncio.ensure_future(anext(iterator))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await registry.publish("first", "file:///m/first")
        assert (await asyncio.wait_for(waiting, 5)).version == "first"


@pytest.mark.parametrize("name", ["", "a/b", "../x", "-x", "x" * 129])
async def test_bad_names_are_refused(store, name):
    registry = WeightRegistry(store)
    with pytest.raises(InvalidWeightVersion, match="must be 1-128 characters"):
        await registry.publish(name, "file:///m")
    with pytest.raises(InvalidWeightVersion):
        WeightRegistry(store, name)


async def test_a_location_is_required(store):
    with pytest.raises(InvalidWeightVersion, match="needs a location"):
        await WeightRegistry(store).publish("v1", "")


@pytest.mark.parametrize("location", ["/srv/models/v1", "models/v1", "://x", "file://"])
async def test_a_location_must_be_a_url(store, location):
    # a host path cannot be read by an engine on another machine
    registry = WeightRegistry(store)
    with pytest.raises(InvalidWeightVersion, match="not a URL"):
        await registry.publish("v1", location)
    assert await registry.latest() is None
