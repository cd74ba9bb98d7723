"""The chat format with screenshots: a vision-language processor renders image parts as its
image token, expanded to the image's features, with the images in token order; a text model
refuses them by name; templates that lose tools or images are refused up front."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from orchard.lm.chat import ChatFormatError, ChatImageError, ChatRenderer, content_text
from orchard.lm.models import IMAGE_TOKEN, tiny_vision_language_model, tiny_vision_processor
from orchard.lm.tokenizer import build_tokenizer
from orchard.lm.vision import (
    VisionChatRenderer,
    decode_image_url,
    is_vision_language_folder,
    message_image_urls,
    vision_chat_template,
)

CLICK = {"type": "function", "function": {"name": "click", "parameters": {"type": "object"}}}


def png_url(color: str, size: tuple[int, int] = (40, 24)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def screenshot(url: str) -> dict[str, object]:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": "Screenshot after click:"},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }


@pytest.fixture(scope="module")
def processor():
    return tiny_vision_processor(image_size=16, patch_size=8)  # 4 tokens an image


@pytest.fixture(scope="module")
def renderer(processor) -> VisionChatRenderer:
    return VisionChatRenderer(processor)


def test_text_renders_as_the_text_template_and_images_as_the_image_token(tokenizer) -> None:
    text_only = [{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"}]
    template = vision_chat_template(IMAGE_TOKEN)
    plain = ChatRenderer(tokenizer)
    with_images = ChatRenderer(tokenizer, template=template)
    assert with_images.render_text(text_only, [CLICK]) == plain.render_text(text_only, [CLICK])
    parts = [
        {"type": "text", "text": "Screenshot:"},
        {"type": "image"},
        {"type": "text", "text": "!"},
    ]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], chat_template=template, tokenize=False
    )
    assert "<|im_start|>user\nScreenshot:<image>!<|im_end|>" in rendered


def test_screenshots_expand_to_their_tokens_and_travel_in_order(renderer) -> None:
    red, blue = png_url("red"), png_url("blue", (30, 60))
    messages = [
        {"role": "system", "content": "You operate a web browser."},
        {"role": "user", "content": "Open the menu."},
        screenshot(red),
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "function": {"name": "click", "arguments": json.dumps({"x": 3})}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "clicked"},
        screenshot(blue),
    ]  # fmt: skip
    prompt = renderer.render(messages, [CLICK])
    assert prompt.text.count(IMAGE_TOKEN) == 2
    assert prompt.token_ids.count(renderer.image_token_id) == 2 * 4
    assert prompt.images == (decode_image_url(red), decode_image_url(blue))
    assert message_image_urls(messages) == [red, blue]
    assert renderer.image_tokens(prompt.images[1]) == 4
    inputs = renderer.pixel_inputs([prompt.images, (prompt.images[0],)])
    assert tuple(inputs["pixel_values"].shape) == (3, 3, 16, 16)
    assert content_text(messages[2]["content"]) == "Screenshot after click:[image]"


def test_a_text_model_refuses_images_by_name(tokenizer) -> None:
    with pytest.raises(ChatImageError, match=r"messages\[0\].*vision-language model"):
        ChatRenderer(tokenizer).render([screenshot(png_url("red"))])


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("https://example.com/a.png", "nothing is fetched"),
        ("data:text/plain;base64,aGk=", "nothing is fetched"),
        ("data:image/png;base64,!!!", "not valid base64"),
        ("data:image/png;base64,aGk=", "not an image"),
    ],
)
def test_only_data_urls_of_images_are_read(renderer, url: str, match: str) -> None:
    with pytest.raises(ChatFormatError, match=match):
        renderer.render([screenshot(url)])


def test_a_template_that_loses_images_or_tools_is_refused(processor) -> None:
    with pytest.raises(ChatFormatError, match="drops an image part"):
        VisionChatRenderer(processor, template=build_tokenizer().chat_template)
    no_tools = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ChatFormatError, match="drops the tool declarations, a tool call"):
        VisionChatRenderer(processor, template=no_tools)


def test_a_processor_without_a_template_gets_orchards(processor) -> None:
    saved = processor.chat_template
    processor.chat_template = None
    try:
        assert VisionChatRenderer(processor).template == vision_chat_template(IMAGE_TOKEN)
    finally:
        processor.chat_template = saved


def test_a_folder_with_a_vision_config_is_a_vision_language_model(tmp_path: Path) -> None:
    processor = tiny_vision_processor(image_size=16, patch_size=8)
    tiny_vision_language_model(processor, image_size=16, patch_size=8).save_pretrained(tmp_path)
    assert is_vision_language_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert not is_vision_language_folder(tmp_path)
    assert not is_vision_language_folder(tmp_path / "missing")
