"""The local engine: PyTorch/transformers on the CPU, the embedded default.

Requests that arrive together (within `batch_window_s` of each other, up to `max_batch_size`)
are sampled as one batch; requests arriving while a batch runs form the next one. The model is a
folder loaded at start, or the versions the trainer publishes in the weight registry: a newer
version is loaded in the background and used from the next batch on, so every generation was
sampled by exactly one version, the one it reports. That lifecycle (start, following the
registry, `load_version`, close) is `orchard.rollout.engines.versioned.VersionedEngine`'s.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from orchard.lm.model_folder import load_model_folder
from orchard.lm.weights import WeightRegistry
from orchard.rollout.engines.base import (
    EngineClosed,
    Generation,
    InvalidRequest,
    NoWeightsLoaded,
    SamplingParams,
)
from orchard.rollout.engines.config import LocalEngineConfig
from orchard.rollout.engines.sampling import sample_batch
from orchard.rollout.engines.versioned import VersionedEngine, fetch_model_folder

__all__ = ["LoadedWeights", "LocalEngine", "LocalEngineConfig", "fetch_model_folder"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    """A model ready to sample, and the version name calls record for it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    version: str

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))


@dataclass(eq=False, slots=True)
class _Request:
    prompt: tuple[int, ...]
    params: SamplingParams
    future: asyncio.Future[Generation]


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

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> Generation:
        if not self.running:
            raise EngineClosed("the engine is not running")
        weights = self._weights()
        prompt = tuple(int(t) for t in prompt_token_ids)
        if not prompt:
            raise InvalidRequest("the prompt must hold at least one token")
        vocab = int(weights.model.config.vocab_size)
        if any(t < 0 or t >= vocab for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) >= weights.context_length:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens; the model's context holds "
                f"{weights.context_length} (prompt and output together)"
            )
        request = _Request(prompt, params, asyncio.get_running_loop().create_future())
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
            rows = await asyncio.to_thread(
                sample_batch,
                weights.model,
                weights.tokenizer,
                [r.prompt for r in batch],
                [r.params for r in batch],
                context_length=weights.context_length,
                stop_event=self._stop,
            )
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


def _load_folder(location: str, version: str) -> LoadedWeights:
    """Load the model folder at `location`: an artifact URL (a published version) or, for an
    operator's `model_folder`, a path on this machine."""
    loaded = load_model_folder(fetch_model_folder(location))
    return LoadedWeights(model=loaded.model, tokenizer=loaded.tokenizer, version=version)
