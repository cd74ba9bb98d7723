"""The local engine on a tiny vision-language model (LLaVA, built in code): it loads the folder
with its processor, samples prompts that bring screenshots exactly as the plain loop over the
whole model does, batches them with text prompts, and refuses images it cannot use."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from orchard.lm.model_folder import load_model_folder, save_model_folder
from orchard.lm.models import tiny_vision_language_model, tiny_vision_processor
from orchard.lm.vision import RenderedVisionPrompt, VisionChatRenderer
from orchard.rollout.engines import sampling
from orchard.rollout.engines.base import (
    InferenceEngine,
    InvalidRequest,
    SamplingParams,
    VisionEngine,
)
from orchard.rollout.engines.local import LocalEngine, LocalEngineConfig

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def png(color: str, size: tuple[int, int] = (40, 24)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def screenshot_messages(color: str) -> list[dict[str, object]]:
    url = "data:image/png;base64," + base64.b64encode(png(color)).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "The page:"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


@pytest.fixture(scope="module")
def vision_folder(tmp_path_factory) -> Path:
    processor = tiny_vision_processor(image_size=16, patch_size=8)  # 4 tokens an image
    model = tiny_vision_language_model(processor, image_size=16, patch_size=8, context=512)
    return save_model_folder(tmp_path_factory.mktemp("vlm") / "llava", model, processor)


@pytest.fixture(scope="module")
def renderer(vision_folder) -> VisionChatRenderer:
    return VisionChatRenderer(load_model_folder(vision_folder).processor)


def render(renderer: VisionChatRenderer, color: str) -> RenderedVisionPrompt:
    prompt = renderer.render(screenshot_messages(color))
    assert isinstance(prompt, RenderedVisionPrompt)
    return prompt


def reference(folder: Path, renderer: VisionChatRenderer, prompt: RenderedVisionPrompt):
    """Greedy decoding the plain way, the whole sequence and the pixels through the model at
    every step: the tokens and each one's log-probability."""
    model = load_model_folder(folder).model
    pixels = renderer.pixel_inputs([prompt.images])
    ids, logprobs = list(prompt.token_ids), []
    with torch.no_grad():
        for _ in range(GREEDY.max_tokens):
            logits = model(input_ids=torch.tensor([ids]), **pixels).logits[0, -1]
            distribution = torch.log_softmax(logits.float(), -1)
            ids.append(int(distribution.argmax()))
            logprobs.append(float(distribution[ids[-1]]))
    return tuple(ids[len(prompt.token_ids) :]), logprobs


def engine_for(folder: Path, **config) -> LocalEngine:
    return LocalEngine(LocalEngineConfig(model_folder=str(folder), weight_version="vlm", **config))


async def test_a_vision_language_folder_loads_with_its_processor(vision_folder):
    async with engine_for(vision_folder) as engine:
        assert isinstance(engine, InferenceEngine)
        assert isinstance(engine, VisionEngine)
        assert engine.processor is not None
        assert engine.context_length == 512  # from text_config


async def test_screenshots_are_sampled_as_the_plain_loop_and_batch_with_text(
    vision_folder, renderer
):
    red, blue = render(renderer, "red"), render(renderer, "blue")
    text = renderer.render([{"role": "user", "content": "List the files, then open one."}])
    # Same tokens, different pixels: the image tokens are expanded (4 an image).
    assert red.token_ids == blue.token_ids
    assert red.token_ids.count(renderer.image_token_id) == 4
    async with engine_for(vision_folder, max_batch_size=4, batch_window_s=0.05) as engine:
        together = await asyncio.gather(
            engine.generate(red.token_ids, GREEDY, images=red.images),
            engine.generate(blue.token_ids, GREEDY, images=blue.images),
            engine.generate(text.token_ids, GREEDY),
        )
        assert engine.batch_sizes == [3]
        alone = await engine.generate(red.token_ids, GREEDY, images=red.images)
    for prompt, generation in ((red, together[0]), (blue, together[1])):
        tokens, logprobs = reference(vision_folder, renderer, prompt)
        assert generation.token_ids == tokens
        assert generation.logprobs == pytest.approx(logprobs, abs=1e-4)
        assert generation.prompt_tokens == len(prompt.token_ids)
    assert alone.token_ids == together[0].token_ids
    assert alone.logprobs == pytest.approx(together[0].logprobs, abs=1e-4)
    # The pixels are used: the same tokens with another screenshot sample from other logits.
    assert abs(together[0].logprobs[0] - together[1].logprobs[0]) > 1e-4
    assert together[2].prompt_tokens == len(text.token_ids)


async def test_images_that_do_not_match_the_prompt_are_refused(vision_folder, renderer):
    red = render(renderer, "red")
    async with engine_for(vision_folder) as engine:
        with pytest.raises(InvalidRequest, match="4 image tokens, its 0 image"):
            await engine.generate(red.token_ids, GREEDY)
        with pytest.raises(InvalidRequest, match="4 image tokens, its 2 image"):
            await engine.generate(red.token_ids, GREEDY, images=red.images * 2)
        with pytest.raises(InvalidRequest, match="not an image"):
            await engine.generate(red.token_ids, GREEDY, images=[b"not a png"])
        assert engine.batches == 0


async def test_a_text_model_refuses_images(model_folders):
    async with engine_for(model_folders["a"]) as engine:
        assert engine.processor is None
        with pytest.raises(InvalidRequest, match="text model: it cannot take images"):
            await engine.generate([1, 2, 3], GREEDY, images=[png("red")])


def test_image_rows_whose_caches_cannot_be_joined_prefill_as_one_padded_batch(
    vision_folder, renderer, monkeypatch
):
    class OtherCache:
        """Stands for any cache class the join does not know (a sliding window's)."""

    loaded = load_model_folder(vision_folder)
    red = render(renderer, "red")
    messages = screenshot_messages("blue")
    messages.insert(0, {"role": "system", "content": "You operate a browser; be brief."})
    blue = renderer.render(messages)
    assert isinstance(blue, RenderedVisionPrompt)
    assert len(blue.token_ids) != len(red.token_ids)
    rows = [red, blue]
    inputs = [renderer.pixel_inputs([row.images]) for row in rows]

    def sample() -> list[sampling.RowResult]:
        return sampling.sample_batch(
            loaded.model,
            loaded.tokenizer,
            [row.token_ids for row in rows],
            [GREEDY, GREEDY],
            context_length=512,
            image_inputs=inputs,
        )

    joined = sample()
    monkeypatch.setattr(sampling, "DynamicCache", OtherCache)
    padded = sample()
    monkeypatch.undo()
    for row, one, other in zip(rows, joined, padded, strict=True):
        tokens, logprobs = reference(vision_folder, renderer, row)
        assert one.token_ids == other.token_ids == tokens
        assert one.logprobs == pytest.approx(logprobs, abs=1e-4)
        assert other.logprobs == pytest.approx(logprobs, abs=1e-4)
