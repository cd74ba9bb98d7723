"""The local engine: PyTorch/transformers on the CPU, the embedded default.

Requests that arrive together (within `batch_window_s` of each other, up to `max_batch_size`)
are sampled as one batch; requests arriving while a batch runs form the next one. The model is a
folder loaded at start, or the versions the trainer publishes in the weight registry: a newer
version is loaded in the background and used from the next batch on, so every generation was
sampled by exactly one version, the one it reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from orchard.core.artifacts import ArtifactError, ArtifactStore, as_url
from orchard.core.etcd import EtcdError
from orchard.lm.model_folder import ModelFolderError, load_model_folder
from orchard.lm.weights import WeightRegistry, WeightVersion
from orchard.rollout.engines.base import (
    EngineClosed,
    Generation,
    InvalidRequest,
    NoWeightsLoaded,
    SamplingParams,
)
from orchard.rollout.engines.sampling import sample_batch

log = logging.getLogger(__name__)


class LocalEngineConfig(BaseModel):
    """The ``local`` engine: a Hugging Face causal LM on this machine's CPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["local"] = Field(default="local", description="Selects this engine.")
    model_folder: str | None = Field(
        default=None,
        description="A model folder to load at start (weights, config, tokenizer). Without it "
        "the engine loads the latest version published in the weight registry.",
    )
    weight_version: str = Field(
        default="local",
        description="The version name recorded for calls sampled from `model_folder`.",
    )
    registry_model: str = Field(
        default="policy", description="Which model's versions to follow in the weight registry."
    )
    follow_registry: bool = Field(
        default=True,
        description="Load each version published after start (when a registry is given).",
    )
    max_batch_size: int = Field(default=8, ge=1, description="Most requests sampled in one batch.")
    batch_window_s: float = Field(
        default=0.005,
        ge=0,
        description="How long a batch waits for more requests after the first one arrives.",
    )
    first_version_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long start() waits for a first published version to load.",
    )
    retry_interval_s: float = Field(
        default=1.0, gt=0, description="Pause before watching the registry again after etcd failed."
    )


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


class LocalEngine:
    """Batched sampling on the CPU; see the module docstring.

    `async with LocalEngine(config, registry=registry) as engine:` loads the weights (the folder
    in `config`, else the latest published version), follows new versions, and serves
    `generate` from any number of concurrent tasks.
    """

    def __init__(
        self,
        config: LocalEngineConfig | None = None,
        *,
        registry: WeightRegistry | None = None,
        weights: LoadedWeights | None = None,
    ) -> None:
        self.config = config or LocalEngineConfig()
        self._registry = registry
        self._current = weights
        self._queue: list[_Request] = []
        self._wakeup = asyncio.Event()
        self._loaded = asyncio.Condition()
        self._stop = threading.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False
        self.batches = 0
        """How many batches ran (for tests and metrics)."""
        self.batch_sizes: list[int] = []
        """The size of each batch that ran, in order."""

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the weights and start the batching loop (and the registry follower)."""
        if self._started:
            raise RuntimeError("the engine is already started")
        self._started = True
        if self._current is None and self.config.model_folder is not None:
            self._current = await asyncio.to_thread(
                _load_folder, self.config.model_folder, self.config.weight_version
            )
        if self._registry is not None and (self._current is None or self.config.follow_registry):
            self._tasks.append(asyncio.create_task(self._follow(self._registry)))
        self._tasks.append(asyncio.create_task(self._serve()))
        if self._current is None:
            if self._registry is None:
                await self.close()
                raise NoWeightsLoaded("the engine needs a model_folder, weights or a registry")
            try:
                async with asyncio.timeout(self.config.first_version_timeout_s):
                    await self.wait_for_weights()
            except TimeoutError:
                await self.close()
                raise NoWeightsLoaded(
                    f"no version of {self.config.registry_model!r} was published and loaded "
                    f"within {self.config.first_version_timeout_s} s"
                ) from None

    async def close(self) -> None:
        """Stop sampling (a running batch ends at its next step) and fail waiting requests."""
        self._closed = True
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for request in self._queue:
            if not request.future.done():
                request.future.set_exception(EngineClosed("the engine was closed"))
        self._queue.clear()

    async def __aenter__(self) -> LocalEngine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

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

    async def use_weights(self, weights: LoadedWeights) -> None:
        """Sample with `weights` from the next batch on."""
        async with self._loaded:
            self._current = weights
            self._loaded.notify_all()
        log.info("local engine now samples with weight version %s", weights.version)

    async def wait_for_weights(self, version: str | None = None) -> None:
        """Wait until weights are loaded (`version` if given); bound it with `asyncio.timeout`."""

        def ready() -> bool:
            current = self._current
            return current is not None and (version is None or current.version == version)

        async with self._loaded:
            await self._loaded.wait_for(ready)

    async def _follow(self, registry: WeightRegistry) -> None:
        """Load every newer published version; etcd outages are retried, bad folders skipped."""
        while True:
            try:
                async with registry.watch() as updates:
                    async for version in updates:
                        await self._load_published(version)
            except EtcdError as e:
                log.warning("weight registry watch failed (%s); retrying", e)
            await asyncio.sleep(self.config.retry_interval_s)

    async def _load_published(self, version: WeightVersion) -> None:
        if self._current is not None and self._current.version == version.version:
            return
        try:
            weights = await asyncio.to_thread(_load_folder, version.location, version.version)
        except (ModelFolderError, OSError, ValueError) as e:
            log.error(
                "cannot load weight version %s from %s: %s", version.version, version.location, e
            )
            return
        await self.use_weights(weights)

    # -- sampling -------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> Generation:
        if self._closed or not self._started:
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


def fetch_model_folder(location: str) -> Path:
    """A local folder holding the model folder at `location`, read through the artifact layer
    (file:// in place on the shared volume; other stores downloaded once per URL).

    The registry is the operator's (only the trainer publishes), so a published URL is the one
    prefix this read may touch; it is still checked for its form (no '..', no chaining).
    A bare path (an operator's `model_folder` setting) is taken as ``file://`` + its absolute
    form.
    """
    try:
        url = as_url(location)
        return ArtifactStore(url).get_dir(url)
    except ArtifactError as e:
        raise ModelFolderError(f"model folder {location}: {e.message}") from None
