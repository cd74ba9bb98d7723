"""The local engine follows the weight registry on a real etcd: it starts on the latest
published version, switches to each newer one between batches, and records which one sampled."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from orchard.core.etcd import EtcdStore
from orchard.lm.model_folder import load_model_folder
from orchard.lm.weights import WeightRegistry
from orchard.rollout.engines.base import NoWeightsLoaded, SamplingParams
from orchard.rollout.engines.local import LocalEngine, LocalEngineConfig

from .conftest import TRAINED_ANSWER, greedy_reference

GREEDY = SamplingParams(max_tokens=10, temperature=0)


@pytest.fixture
async def registry(etcd):
    async with EtcdStore(etcd.endpoint, namespace=f"test/{uuid.uuid4().hex}/") as store:
        yield WeightRegistry(store, "policy")
        await store.delete_prefix("")


async def test_a_published_version_changes_the_outputs_to_that_models(
    registry, model_folders, tokenizer
):
    prompt = tokenizer.encode("<|im_start|>user\nList the files.<|im_end|>\n")
    expected = {
        name: tuple(greedy_reference(load_model_folder(folder).model, prompt, 10))
        for name, folder in model_folders.items()
    }
    assert expected["a"] != expected["b"]
    assert tokenizer.decode(list(expected["b"]), skip_special_tokens=True) == TRAINED_ANSWER

    await registry.publish("step-1", str(model_folders["a"]))
    async with LocalEngine(LocalEngineConfig(), registry=registry) as engine:
        assert engine.weight_version == "step-1"
        first = await engine.generate(prompt, GREEDY)
        assert (first.token_ids, first.weight_version) == (expected["a"], "step-1")

        await registry.publish("step-2", str(model_folders["b"]), {"step": "2"})
        await asyncio.wait_for(engine.wait_for_weights("step-2"), 30)
        second = await engine.generate(prompt, GREEDY)
        assert (second.token_ids, second.weight_version) == (expected["b"], "step-2")
        assert second.finish_reason == "length"


async def test_a_batch_in_flight_finishes_on_its_version(registry, model_folders, tokenizer):
    prompt = tokenizer.encode("Run the tests.")
    await registry.publish("v1", str(model_folders["a"]))
    async with LocalEngine(LocalEngineConfig(), registry=registry) as engine:
        running = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_tokens=60)))
        await asyncio.sleep(0.02)
        await registry.publish("v2", str(model_folders["b"]))
        await asyncio.wait_for(engine.wait_for_weights("v2"), 30)
        assert (await running).weight_version == "v1"
        assert (await engine.generate(prompt, GREEDY)).weight_version == "v2"


async def test_an_unloadable_version_is_skipped(registry, model_folders, tmp_path, tokenizer):
    await registry.publish("good", str(model_folders["a"]))
    async with LocalEngine(LocalEngineConfig(), registry=registry) as engine:
        await registry.publish("broken", str(tmp_path / "missing"))
        await registry.publish("next", str(model_folders["b"]))
        await asyncio.wait_for(engine.wait_for_weights("next"), 30)
        result = await engine.generate(tokenizer.encode("hi"), GREEDY)
        assert result.weight_version == "next"


async def test_start_waits_for_a_first_version(registry, model_folders):
    engine = LocalEngine(LocalEngineConfig(first_version_timeout_s=30), registry=registry)
    starting = asyncio.ensure_future(engine.start())
    await asyncio.sleep(0.1)
    assert not starting.done()
    await registry.publish("first", str(model_folders["a"]))
    await starting
    assert engine.weight_version == "first"
    await engine.close()


async def test_start_gives_up_when_nothing_is_published(registry):
    engine = LocalEngine(LocalEngineConfig(first_version_timeout_s=0.2), registry=registry)
    with pytest.raises(NoWeightsLoaded, match="no version of 'policy' was published"):
        await engine.start()
