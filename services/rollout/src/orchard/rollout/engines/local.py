"""The local engine: PyTorch/transformers on the CPU, the embedded default.

Requests that arrive together (within `batch_window_s` of each other, up to `max_batch_size`)
are sampled as one batch; requests arriving while a batch runs form the next one. The model is a
folder loaded at start, or the versions the trainer publishes in the weight registry: a newer
version is loaded in the background and used from the next batch on, so every generation was
sampled by exactly one version, the one it reports. That lifecycle (start, following the
registry, `load_version`, close) is `orchard.rollout.engines.versioned.VersionedEngine`'s.

A vision-language model folder (a ``vision_config`` in its config: LLaVA and the like) loads with
its processor; a request may then bring images with its prompt (`generate(..., images=...)`),
whose token ids the processor rendered. Its prefill runs alone, with the pixel values the
processor makes of its images, and its decoding joins the batch like any text row (KV cache).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from orchard.lm.chat import ChatFormatError
from orchard.lm.model_folder import load_model_folder
from orchard.lm.vision import VisionChatRenderer
from orchard.lm.weights import WeightRegistry
from orchard.rollout.engines.base import (
    EngineClosed,
    Generation,
    InvalidRequest,
    NoWeightsLoaded,
    SamplingParams,
)
from orchard.rollout.engines.config import LocalEngineConfig
from orchard.rollout.engines.sampling import RowResult, sample_batch
from orchard.rollout.engines.versioned import VersionedEngine, fetch_model_folder

__all__ = ["LoadedWeights", "LocalEngine", "LocalEngineConfig", "fetch_model_folder"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    """A model ready to sample, and the version name calls record for it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    version: str
    vision: VisionChatRenderer | None = None
    """A vision-language model's renderer (its processor's images and image token); None for a
    text model."""

    @property
    def context_length(self) -> int:
        # A vision-language model keeps its language model's settings in `text_config`.
        text = self.model.config.get_text_config()
        return int(getattr(text, "max_position_embeddings", 2048))

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)


@dataclass(eq=False, slots=True)
class _Request:
    prompt: tuple[int, ...]
    params: SamplingParams
    future: asyncio.Future[Generation]
    images: tuple[bytes, ...] = ()


class LocalEngine(VersionedEngine[LocalEngineConfig]):
    """Batched sampling on the CPU; see the module docstring.

    `async with LocalEngine(config, registry=registry) as engine:` loads the weights (the folder
    in `config`, else the latest published version), follows new versions, and serves
    `generate` from any number of concurrent tasks. The lifecycle (start, following the
    registry, `load_version`, close) is `VersionedEngine`'s.
    """

    def __init__(
        self,
        config: LocalEngineConfig | None = None,
        *,
        registry: WeightRegistry | None = None,
        weights: LoadedWeights | None = None,
    ) -> None:
        super().__init__(config or LocalEngineConfig(), registry=registry)
        self._current = weights
        self._queue: list[_Request] = []
        self._wakeup = asyncio.Event()
        self._stop = threading.Event()
        self.batches = 0
        """How many batches ran (for tests and metrics)."""
        self.batch_sizes: list[int] = []
        """The size of each batch that ran, in order."""

    # -- lifecycle ------------------------------------------------------------------------

    def _on_start(self) -> None:
        self._spawn(self._serve())

    def _interrupt(self) -> None:
        self._stop.set()  # a running batch ends at its next step

    async def _shutdown(self) -> None:
        for request in self._queue:
            if not request.future.done():
                request.future.set_exception(EngineClosed("the engine was closed"))
        self._queue.clear()

    # -- weights --------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._current.version if self._current is not None else ""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._weights().tokenizer

    @property
    def context_length(self) -> int:
        return self._weights().context_length

    @property
    def processor(self) -> Any | None:
        current = self._current
        return current.vision.processor if current is not None and current.vision else None

    def _weights(self) -> LoadedWeights:
        if self._current is None:
            raise NoWeightsLoaded("the engine has no model loaded yet")
        return self._current

    async def _swap(self, version: str, folder: str) -> None:
        # the batch running now keeps the weights it started with
        self._current = await asyncio.to_thread(_load_folder, folder, version)

    async def use_weights(self, weights: LoadedWeights) -> None:
        """Sample with `weights` (already loaded) from the next batch on."""
        async with self._loading:
            self._current = weights
        await self._announce()
        log.info("local engine now samples with weight version %s", weights.version)

    # -- sampling -------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        images: Sequence[bytes] = (),
    ) -> Generation:
        """Sample one completion of `prompt_token_ids`; a vision-language model's prompt may
        bring `images` (encoded bytes, in the order of their tokens in the prompt)."""
        if not self.running:
            raise EngineClosed("the engine is not running")
        weights = self._weights()
        prompt = tuple(int(t) for t in prompt_token_ids)
        if not prompt:
            raise InvalidRequest("the prompt must hold at least one token")
        vocab = weights.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) >= weights.context_length:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens; the model's context holds "
                f"{weights.context_length} (prompt and output together)"
            )
        pictures = tuple(bytes(i) for i in images)
        if weights.vision is not None and pictures:
            # A mismatch would fail the model's forward pass, and with it the whole batch.
            await asyncio.to_thread(_check_image_tokens, weights.vision, prompt, pictures)
        elif weights.vision is not None:
            _check_image_tokens(weights.vision, prompt, pictures)
        elif pictures:
            raise InvalidRequest(
                f"weight version {weights.version!r} is a text model: it cannot take images"
            )
        request = _Request(prompt, params, asyncio.get_running_loop().create_future(), pictures)
        self._queue.append(request)
        self._wakeup.set()
        return await request.future

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            if self.config.batch_window_s:
                await asyncio.sleep(self.config.batch_window_s)
            self._wakeup.clear()
            batch = [r for r in self._queue if not r.future.done()][: self.config.max_batch_size]
            taken = {id(r) for r in batch}
            self._queue = [r for r in self._queue if id(r) not in taken and not r.future.done()]
            if self._queue:
                self._wakeup.set()
            if not batch or self._current is None:
                continue
            await self._run(self._current, batch)

    async def _run(self, weights: LoadedWeights, batch: list[_Request]) -> None:
        self.batches += 1
        self.batch_sizes.append(len(batch))
        try:
            rows = await asyncio.to_thread(_sample, weights, batch, self._stop)
        except asyncio.CancelledError:
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(EngineClosed("the engine was closed"))
            raise
        except Exception as e:
            log.exception("a batch of %d requests failed", len(batch))
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(e)
            return
        for request, row in zip(batch, rows, strict=True):
            if not request.future.done():
                request.future.set_result(
                    Generation(
                        token_ids=row.token_ids,
                        logprobs=row.logprobs,
                        finish_reason=row.finish_reason,
                        weight_version=weights.version,
                        prompt_tokens=len(request.prompt),
                    )
                )


def _check_image_tokens(
    vision: VisionChatRenderer, prompt: tuple[int, ...], images: tuple[bytes, ...]
) -> None:
    """Raise `InvalidRequest` unless the prompt holds exactly the image tokens of `images`."""
    try:
        expected = sum(vision.image_tokens(image) for image in images)
    except ChatFormatError as e:
        raise InvalidRequest(str(e)) from None
    found = sum(1 for t in prompt if t == vision.image_token_id)
    if found != expected:
        raise InvalidRequest(
            f"the prompt holds {found} image tokens, its {len(images)} image(s) make "
            f"{expected}: render the prompt with the model's processor "
            "(orchard.lm.vision.VisionChatRenderer)"
        )


def _sample(
    weights: LoadedWeights, batch: Sequence[_Request], stop: threading.Event
) -> list[RowResult]:
    """`sample_batch` of the batch, each row's images run through the processor first."""
    image_inputs: list[dict[str, torch.Tensor]] | None = None
    if weights.vision is not None and any(r.images for r in batch):
        dtype = weights.model.dtype
        image_inputs = [
            {
                key: value.to(dtype) if value.is_floating_point() else value
                for key, value in weights.vision.pixel_inputs([r.images]).items()
            }
            for r in batch
        ]
    return sample_batch(
        weights.model,
        weights.tokenizer,
        [r.prompt for r in batch],
        [r.params for r in batch],
        context_length=weights.context_length,
        stop_event=stop,
        image_inputs=image_inputs,
    )


def _load_folder(location: str, version: str) -> LoadedWeights:
    """Load the model folder at `location`: an artifact URL (a published version) or, for an
    operator's `model_folder`, a path on this machine."""
    loaded = load_model_folder(fetch_model_folder(location))
    vision = VisionChatRenderer(loaded.processor) if loaded.processor is not None else None
    return LoadedWeights(
        model=loaded.model, tokenizer=loaded.tokenizer, version=version, vision=vision
    )
