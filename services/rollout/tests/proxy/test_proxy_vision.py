"""The capture proxy in front of the local engine on a tiny vision-language model (LLaVA, built
in code): a chat completion with a PNG screenshot is rendered with the model's processor, as the
trainer renders it, its pixels reach the engine, and the call is recorded with the expanded
image tokens; a text policy refuses a screenshot naming the fix."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import openai
import pytest
from PIL import Image

from orchard.lm.model_folder import load_model_folder, save_model_folder
from orchard.lm.models import tiny_vision_language_model, tiny_vision_processor
from orchard.lm.vision import VisionChatRenderer
from orchard.rollout.engines.local import LocalEngine, LocalEngineConfig
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig

from .conftest import BASH


def screenshot_url(color: str) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 40), color).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def gui_messages(color: str) -> list[dict[str, object]]:
    return [
        {"role": "system", "content": "You operate a browser."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Open the settings. The screen:"},
                {"type": "image_url", "image_url": {"url": screenshot_url(color)}},
            ],
        },
    ]


@pytest.fixture(scope="module")
def vision_folder(tmp_path_factory) -> Path:
    processor = tiny_vision_processor(image_size=16, patch_size=8)  # 4 tokens an image
    model = tiny_vision_language_model(processor, image_size=16, patch_size=8, context=512)
    return save_model_folder(tmp_path_factory.mktemp("vlm") / "llava", model, processor)


@pytest.fixture
async def vision_proxy(vision_folder):
    config = LocalEngineConfig(model_folder=str(vision_folder), weight_version="vlm-v1")
    async with (
        LocalEngine(config) as engine,
        CaptureProxy(engine, CaptureProxyConfig(settle_quiet_s=0.05)) as proxy,
    ):
        yield proxy


def client_for(endpoint) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)


async def test_a_screenshot_is_rendered_with_the_processor_and_recorded(
    vision_proxy, vision_folder
):
    renderer = VisionChatRenderer(load_model_folder(vision_folder).processor)
    records = {}
    for color in ("red", "blue"):
        messages = gui_messages(color)
        endpoint = vision_proxy.open_session(f"r-{color}")
        async with client_for(endpoint) as client:
            completion = await client.chat.completions.create(
                model="policy", messages=messages, tools=[BASH], temperature=0, max_tokens=5
            )
        assert completion.choices[0].finish_reason == "length"
        [record] = await vision_proxy.settle(f"r-{color}", timeout=10)
        records[color] = record
        # Exactly the trainer's rendering (PrepareDataset uses the same renderer): the image
        # token expanded into the screenshot's 4 feature tokens.
        assert record.prompt_token_ids == renderer.render(messages, [BASH]).token_ids
        assert record.prompt_token_ids.count(renderer.image_token_id) == 4
        assert completion.usage.prompt_tokens == len(record.prompt_token_ids)
        assert len(record.output_token_ids) == 5 == len(record.output_logprobs)
        assert all(lp <= 0 for lp in record.output_logprobs)
        assert record.weight_version == "vlm-v1"
        assert record.metadata["images"] == "1"
        assert record.request_messages == tuple(messages)  # the data URL stays here
    red, blue = records["red"], records["blue"]
    # Same prompt tokens, other pixels: other logits, so the engine got the screenshot.
    assert red.prompt_token_ids == blue.prompt_token_ids
    assert abs(red.output_logprobs[0] - blue.output_logprobs[0]) > 1e-4


async def test_a_text_conversation_still_works_on_a_vision_language_policy(vision_proxy):
    endpoint = vision_proxy.open_session("r-text")
    async with client_for(endpoint) as client:
        completion = await client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "Hi"}],
            temperature=0,
            max_tokens=3,
        )
    assert completion.usage.completion_tokens == 3
    [record] = await vision_proxy.settle("r-text", timeout=10)
    assert "images" not in record.metadata


async def test_a_text_policy_refuses_a_screenshot_naming_the_fix(proxy):
    endpoint = proxy.open_session("r-text-policy")
    async with client_for(endpoint) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="policy", messages=gui_messages("red"))
    error = caught.value.body
    assert error["code"] == "image_input_unsupported"
    assert error["param"] == "messages"
    assert error["message"].startswith("messages[1].content holds an image")
    assert "builtin:browser-text" in error["message"]
    assert "vision-language model" in error["message"]
