"""Vision-language models: the chat format with screenshots, and the renderer from OpenAI messages
with image parts to a model's prompt tokens and images.

A conversation of the GUI domain carries screenshots as OpenAI content parts
(``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``). A
vision-language model folder (a Hugging Face folder whose config has a ``vision_config``, with a
processor: image processor, tokenizer, image token) renders such a message with its processor's
chat template, where each image becomes the processor's image token, and the processor expands
each image token into as many tokens as the image gives features. `VisionChatRenderer` does
that, so its token ids line up with the pixel values the same processor makes of the same
images (`pixel_inputs`).

A folder whose processor has no chat template is rendered with `vision_chat_template`: Orchard's
ChatML with tool calls (`orchard.lm.chat`), each image part written as the image token. A
template that loses what the GUI loop needs (the tools, a tool call, the image) is refused
when the renderer is built, instead of rendering training data without it.

Only ``data:`` URLs are read: a renderer never fetches anything.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchard.lm.chat import (
    IMAGE_PART,
    ChatFormatError,
    ChatRenderer,
    RenderedPrompt,
    chat_template,
    image_part_url,
    normalize_messages,
)

if TYPE_CHECKING:
    import torch
    from PIL import Image

__all__ = [
    "RenderedVisionPrompt",
    "VisionChatRenderer",
    "decode_image_url",
    "is_vision_language_config",
    "is_vision_language_folder",
    "message_image_urls",
    "open_image",
    "vision_chat_template",
]

_CONTENT_MACRO = """\
{%- macro content(value) -%}
{%- if value is string -%}{{ value }}
{%- else -%}{%- for part in value -%}
{%- if part.type == 'image' -%}IMAGE_TOKEN
{%- elif part.type == 'text' -%}{{ part.text }}
{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
"""

_PROBE_TOOL = "orchard_probe_tool"
_PROBE_IMAGE = {"type": IMAGE_PART, "image_url": {"url": "data:image/png;base64,"}}


def vision_chat_template(image_token: str) -> str:
    """Orchard's ChatML template with tool calls (`orchard.lm.chat.chat_template`), whose
    message contents may be lists of text and ``{"type": "image"}`` parts: each image part is
    written as `image_token`, the text parts as they are."""
    if "{" in image_token or "}" in image_token:
        raise ValueError(f"image token {image_token!r} must not hold braces")
    body = chat_template()
    body = body.replace("{{ messages[0].content }}", "{{ content(messages[0].content) }}")
    body = body.replace("{{ message.content }}", "{{ content(message.content) }}")
    return _CONTENT_MACRO.replace("IMAGE_TOKEN", image_token) + body


def is_vision_language_config(config: Mapping[str, Any]) -> bool:
    """Whether a model's ``config.json`` (as a dict) is a vision-language model's: it has a
    ``vision_config`` (LLaVA, Qwen2-VL, Idefics3/SmolVLM, Gemma 3 and others do)."""
    return isinstance(config.get("vision_config"), Mapping)


def is_vision_language_folder(folder: str | Path) -> bool:
    """Whether the model folder's ``config.json`` is a vision-language model's (False when it
    has none or it is not JSON)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, Mapping) and is_vision_language_config(config)


def decode_image_url(url: str) -> bytes:
    """The bytes of an image given as a ``data:image/...;base64,`` URL; raises
    `ChatFormatError` for any other URL (nothing is fetched) or bad base64."""
    head, comma, data = url.partition(",")
    if not (comma and head.startswith("data:image/") and head.endswith(";base64")):
        shown = url if len(url) <= 60 else url[:57] + "..."
        raise ChatFormatError(
            f"image URL {shown!r}: only data:image/...;base64 URLs are read (nothing is fetched)"
        )
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ChatFormatError(f"image data URL is not valid base64: {exc}") from None


def open_image(data: bytes) -> Image.Image:
    """An image's bytes (PNG, JPEG...) as an RGB PIL image; raises `ChatFormatError` when they
    are not an image PIL reads."""
    from PIL import Image, UnidentifiedImageError  # noqa: PLC0415

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ChatFormatError(f"an image part is not an image PIL can read: {exc}") from None


def _image_size(data: bytes) -> tuple[int, int]:
    """An image's (width, height) from its header, without decoding its pixels."""
    from PIL import Image, UnidentifiedImageError  # noqa: PLC0415

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ChatFormatError(f"an image part is not an image PIL can read: {exc}") from None


def message_image_urls(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The URLs of the image parts of `messages`, in the order a template renders them."""
    urls: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and part.get("type") == IMAGE_PART:
                    urls.append(image_part_url(part))
    return urls


@dataclass(frozen=True, slots=True)
class RenderedVisionPrompt(RenderedPrompt):
    """A prompt of a vision-language model: token ids (each image's tokens expanded) and the
    encoded bytes of its images, in the order their tokens appear."""

    images: tuple[bytes, ...] = ()


_EXTRA_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})
_DECODED_KEPT = 64
"""Decoded images kept by URL: a conversation is rendered once per assistant turn."""


class VisionChatRenderer(ChatRenderer):
    """Renders OpenAI messages with image parts for one vision-language processor.

    The template is the one given, else the processor's own (`processor.chat_template`), else
    `vision_chat_template` with the processor's image token; it is checked once here (raises
    `ChatFormatError` when it drops the tools, a tool call or the image). `render` returns a
    `RenderedVisionPrompt`; `pixel_inputs` turns the images of a batch into the model's
    inputs (``pixel_values`` and what else the processor gives).
    """

    def __init__(self, processor: Any, *, template: str | None = None) -> None:
        tokenizer = getattr(processor, "tokenizer", None)
        image_token = getattr(processor, "image_token", None)
        if tokenizer is None or not isinstance(image_token, str) or not image_token:
            raise ChatFormatError(
                f"{type(processor).__name__} is not a vision-language processor: it needs a "
                "tokenizer and an image token (processor.image_token)"
            )
        own = getattr(processor, "chat_template", None)
        chosen = template or (own if isinstance(own, str) and own else None)
        super().__init__(tokenizer, template=chosen or vision_chat_template(image_token))
        self.processor = processor
        self.tokenizer = tokenizer
        self.image_token = image_token
        token_id = tokenizer.convert_tokens_to_ids(image_token)
        if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None):
            raise ChatFormatError(f"the tokenizer has no token for the image token {image_token!r}")
        self.image_token_id = token_id
        self._lock = threading.Lock()
        self._decoded: OrderedDict[str, Image.Image] = OrderedDict()
        self._tokens_by_size: dict[tuple[int, int], int] = {}
        self._check_template()

    def _normalize(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return normalize_messages(messages, images=True)

    def _check_template(self) -> None:
        """Refuse a template that loses what the GUI loop's conversations hold."""
        arguments = json.dumps({"x": 1})
        probe: list[dict[str, Any]] = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "t"}, _PROBE_IMAGE]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c0",
                        "function": {"name": _PROBE_TOOL + "_call", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c0", "content": "done"},
        ]
        tools = [{"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {}}}]
        try:
            text = self.render_text(probe, tools, add_generation_prompt=True)
        except Exception as exc:  # a template error of any kind: the folder's template is bad
            raise ChatFormatError(f"the chat template cannot render tool calls: {exc}") from None
        missing = [
            what
            for what, needle in (
                ("the tool declarations", _PROBE_TOOL + '"'),
                ("a tool call", _PROBE_TOOL + "_call"),
                ("an image part", self.image_token),
            )
            if needle not in text
        ]
        if missing:
            raise ChatFormatError(
                f"the processor's chat template drops {', '.join(missing)}; save a template that "
                "renders tools, tool calls and images into the folder (for example "
                f"orchard.lm.vision.vision_chat_template({self.image_token!r}))"
            )

    # -- images ----------------------------------------------------------------------------

    def image(self, url: str) -> Image.Image:
        """The image of a data URL, decoded once (the last few are kept)."""
        with self._lock:
            found = self._decoded.get(url)
            if found is not None:
                self._decoded.move_to_end(url)
                return found
        image = open_image(decode_image_url(url))
        with self._lock:
            self._decoded[url] = image
            while len(self._decoded) > _DECODED_KEPT:
                self._decoded.popitem(last=False)
        return image

    def image_tokens(self, image: bytes) -> int:
        """How many image tokens the processor expands one image into (known by its size
        once one image of that size was expanded)."""
        size = _image_size(image)
        with self._lock:
            known = self._tokens_by_size.get(size)
        if known is not None:
            return known
        opened = open_image(image)
        encoded = self.processor(
            text=[self.image_token], images=[[opened]], add_special_tokens=False
        )
        ids = list(encoded["input_ids"][0])
        count = sum(1 for t in ids if int(t) == self.image_token_id)
        with self._lock:
            self._tokens_by_size[size] = count
        return count

    def pixel_inputs(self, images: Sequence[Sequence[bytes]]) -> dict[str, torch.Tensor]:
        """The model inputs of the images of a batch (one sequence of images per row that has
        any, in the order of their tokens): ``pixel_values`` and whatever else the processor
        gives (image sizes, grids, masks), as tensors."""
        import torch  # noqa: PLC0415

        rows = [[open_image(data) for data in row] for row in images if row]
        if not rows:
            return {}
        encoded = self.processor(
            text=[self.image_token * len(row) for row in rows],
            images=rows,
            return_tensors="pt",
            padding=True,
        )
        return {
            key: value
            for key, value in encoded.items()
            if key not in _EXTRA_KEYS and isinstance(value, torch.Tensor)
        }

    # -- rendering -------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> RenderedVisionPrompt:
        """The prompt's token ids, each image's tokens expanded, and its images' bytes."""
        text = self.render_text(messages, tools, add_generation_prompt=add_generation_prompt)
        urls = message_image_urls(messages)
        images = [self.image(url) for url in urls]
        if text.count(self.image_token) != len(images):
            raise ChatFormatError(
                f"the rendered prompt holds {text.count(self.image_token)} image token(s) for "
                f"{len(images)} image part(s): write {self.image_token!r} only for images"
            )
        encoded = self.processor(
            text=[text], images=[images] if images else None, add_special_tokens=False
        )
        ids = tuple(int(t) for t in encoded["input_ids"][0])
        return RenderedVisionPrompt(
            token_ids=ids, text=text, images=tuple(decode_image_url(u) for u in urls)
        )
