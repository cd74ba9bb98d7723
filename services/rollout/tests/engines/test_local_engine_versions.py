"""The local engine follows the weight registry on a real etcd: it starts on the latest
published version, switches to each newer one between batches, and records which one sampled."""

from __future__ import annotations

import asyncio
import os
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

    await registry.publish("step-1", model_folders["a"].as_uri())
    async with LocalEngine(LocalEngineConfig(), registry=registry) as engine:
        assert engine.weight_version == "step-1"
        first = await engine.generate(prompt, GREEDY)
        assert (first.token_ids, first.weight_version) == (expected["a"], "step-1")

        await registry.publish("step-2", model_folders["b"].as_uri(), {"step": "2"})
        await asyncio.wait_for(engine.wait_for_weights("step-2"), 30)
        second = await engine.generate(prompt, GREEDY)
        assert (second.token_ids, second.weight_version) == (expected["b"], "step-2")
        assert second.finish_reason == "length"


async def test_a_batch_in_flight_finishes_on_its_version(registry, model_folders, tokenizer):
    prompt = tokenizer.encode("Run the tests.")
    await registry.publish("v1", model_folders["a"].as_uri())
    async with LocalEngine(LocalEngineConfig(), registry=registry) as engine:
        running = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_tokens=60)))
        await asyncio.sleep(0.02)
        await registry.publish("v2", model_folders["b"].as_uri())
        await asyncio.wait_for(engine.wait_for_weights("v2"), 30)
        assert (await running).weight_version == "v1"
        assert (await engine.generate(prompt, GREEDY)).weight_version == "v2"


async def test_an_unloadable_version_is_skipped(registry, model_folders, tmp_path, tokenizer):
    await registry.publish("good", model_folders["a"].as_uri())
    async with LocalEngine(LocalEngineConfig(), registry=registry) as engine:
        await registry.publish("broken", (tmp_path / "missing").as_uri())
        await registry.publish("next", model_folders["b"].as_uri())
        await asyncio.wait_for(engine.wait_for_weights("next"), 30)
        result = await engine.generate(tokenizer.encode("hi"), GREEDY)
        assert result.weight_version == "next"


async def test_start_waits_for_a_first_version(registry, model_folders):
    engine = LocalEngine(LocalEngineConfig(first_version_timeout_s=30), registry=registry)
    starting = asyncio.ensure_future(engine.start())
    await asyncio.sleep(0.1)
    assert not starting.done()
    await registry.publish("first", model_folders["a"].as_uri())
    await starting
    assert engine.weight_version == "first"
    await engine.close()


async def test_start_gives_up_when_nothing_is_published(registry):
    engine = LocalEngine(LocalEngineConfig(first_version_timeout_s=0.2), registry=registry)
    with pytest.raises(NoWeightsLoaded, match="no version of 'policy' was published"):
        await engine.start()


async def test_a_version_in_an_object_store_is_downloaded_and_loaded(
    registry, model_folders, tokenizer, tmp_path, monkeypatch
):
    # memory:// stands in for an object store: not a path the engine could open directly
    import fsspec

    from orchard.core.artifacts import ArtifactStore

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the download cache lands here, cleaned up
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    bucket = f"weights-{uuid.uuid4().hex[:8]}"
    store = ArtifactStore(f"memory://{bucket}")
    try:
        url = store.put_dir(model_folders["b"], store.url("step-9", "model"))
        prompt = tokenizer.encode("<|im_start|>user\nList the files.<|im_end|>\n")
        expected = tuple(greedy_reference(load_model_folder(model_folders["b"]).model, prompt, 10))
        await registry.publish("step-9", url)
        async with LocalEngine(LocalEngineConfig(), registry=registry) as engine:
            result = await engine.generate(prompt, GREEDY)
            assert (result.token_ids, result.weight_version) == (expected, "step-9")
    finally:
        fsspec.filesystem("memory").rm(f"/{bucket}", recursive=True)
    assert [p.name for p in tmp_path.iterdir()] == [f"orchard-artifact-cache-{os.getuid()}"]


async def test_a_malformed_published_location_is_skipped(registry, model_folders, tokenizer):
    await registry.publish("good", model_folders["a"].as_uri())
    async with LocalEngine(LocalEngineConfig(), registry=registry) as engine:
        sneaky = model_folders["b"].as_uri().replace("/b", "/a/../b")
        await registry.publish("sneaky", sneaky)
        await registry.publish("next", model_folders["b"].as_uri())
        await asyncio.wait_for(engine.wait_for_weights("next"), 30)
        assert engine.weight_version == "next"
