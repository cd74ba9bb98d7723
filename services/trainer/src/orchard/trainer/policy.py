"""Where the policy's starting weights come from: a local Hugging Face model or one built in code.

`model` names are the `TrainingJobSpec.model` strings:

- `builtin:<size>` — a small Qwen2 model built from a config in code with seeded weights
  (`tiny` 0.2 M parameters, `small` 0.85 M, `medium` 5.3 M, `large` 20 M, and `tiny-32k`:
  tiny's shape with a 32,768-token context, enough for the 12-23k tokens of system prompt and
  tool schemas real agent programs send), with Orchard's
  offline tokenizer (`orchard.lm.tokenizer`, the one the local inference engine uses), which
  reports the size's context as its `model_max_length`; nothing is downloaded;
- anything else — a local directory holding a Hugging Face causal LM (`config.json` and
  weights, and its tokenizer when it has one), loaded with `local_files_only`, so a missing
  file fails here instead of reaching for a hub;
- a directory whose `config.json` has a ``vision_config`` — a vision-language model, loaded
  with `AutoModelForImageTextToText` and its `AutoProcessor` (which it must carry), its vision
  encoder frozen (`orchard.trainer.vision`).

A policy builds its own SFT samples and micro-batches (`sft_samples`, `build_sft_samples`,
`collate`): a text model's are token ids; a vision-language model's carry its screenshots.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from orchard.lm.chat import ChatFormatError
from orchard.lm.models import tiny_causal_lm
from orchard.lm.tokenizer import build_tokenizer
from orchard.lm.vision import VisionChatRenderer, is_vision_language_folder
from orchard.trainer.batch import TokenBatch, collate
from orchard.trainer.masks import Sample, SampleConfig, SampleSet, Skip, build_sft_samples
from orchard.trainer.masks import sft_samples as text_sft_samples
from orchard.trainer.vision import FrozenVision, VisionInputs, freeze_vision_encoder
from orchard.types.v1 import trajectory_pb2

__all__ = ["BUILTIN_SIZES", "BuiltinSize", "Policy", "PolicyError", "load_policy"]

log = logging.getLogger(__name__)


class PolicyError(ValueError):
    """A model name that names nothing loadable."""


@dataclass(frozen=True, slots=True)
class BuiltinSize:
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    context: int
    """Tokens of prompt and output together (`max_position_embeddings`)."""


BUILTIN_SIZES: dict[str, BuiltinSize] = {
    "tiny": BuiltinSize(hidden_size=64, layers=2, heads=4, kv_heads=2, context=2048),
    "small": BuiltinSize(hidden_size=128, layers=4, heads=4, kv_heads=2, context=2048),
    # A few million parameters: a student with room to learn a suite of a few hundred tasks.
    "medium": BuiltinSize(hidden_size=256, layers=8, heads=8, kv_heads=4, context=2048),
    # Twice medium's width: a teacher for a medium student (on-policy distillation).
    "large": BuiltinSize(hidden_size=512, layers=8, heads=8, kv_heads=4, context=2048),
    # Holds an agent program's whole prompt. SDPA keeps attention memory linear in the length
    # when nothing is padded: 1.1 GiB to train on one 32k sequence (bench/context_bench.py).
    "tiny-32k": BuiltinSize(hidden_size=64, layers=2, heads=4, kv_heads=2, context=32768),
}


@dataclass(frozen=True, slots=True)
class Policy:
    """A model to train and the tokenizer its token ids belong to."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    """None for a local model folder that carries no tokenizer."""
    processor: Any | None = None
    """A vision-language model's processor (its tokenizer is `tokenizer`); None for text."""
    vision: VisionInputs | None = None
    """How a vision-language model's samples carry their images; None for text."""
    frozen: FrozenVision | None = None
    """What of a vision-language model is frozen; None for text."""

    @property
    def pad_id(self) -> int:
        if self.tokenizer is not None and self.tokenizer.pad_token_id is not None:
            return int(self.tokenizer.pad_token_id)
        pad = getattr(self.model.config, "pad_token_id", None)
        if not isinstance(pad, int):
            pad = getattr(self.model.config.get_text_config(), "pad_token_id", None)
        return int(pad) if isinstance(pad, int) else 0

    @property
    def vocab_size(self) -> int:
        """The language model's vocabulary (a vision-language config keeps it in its text
        config)."""
        return int(self.model.config.get_text_config().vocab_size)

    @property
    def saved_with(self) -> Any:
        """What a model folder saves beside the weights: the processor of a vision-language
        model (its tokenizer included), else the tokenizer."""
        return self.processor if self.processor is not None else self.tokenizer

    def sft_samples(
        self, row: trajectory_pb2.Trajectory, config: SampleConfig
    ) -> list[Sample | Skip]:
        """`masks.sft_samples`, with the images of a vision-language model's samples."""
        if self.vision is not None:
            return self.vision.sft_samples(row, config)
        return text_sft_samples(row, config)

    def build_sft_samples(
        self, rows: Iterable[trajectory_pb2.Trajectory], config: SampleConfig
    ) -> SampleSet:
        """`masks.build_sft_samples`, with the images of a vision-language model's samples."""
        if self.vision is not None:
            return self.vision.build_sft_samples(rows, config)
        return build_sft_samples(rows, config)

    def collate(self, samples: Sequence[Sample], pad_id: int | None = None) -> TokenBatch:
        """A micro-batch of `samples` (padded with `pad_id`, default the policy's), with a
        vision-language model's pixel values."""
        pad = self.pad_id if pad_id is None else pad_id
        if self.vision is not None:
            return self.vision.collate(samples, pad)
        return collate(samples, pad_id=pad)


def load_policy(model: str, *, vocab_size: int | None = None, seed: int = 0) -> Policy:
    """The model `model` names (see the module docstring).

    `vocab_size` sizes a built-in model's embedding for token ids outside any tokenizer
    (synthetic tasks); None sizes it for the offline tokenizer.
    """
    if model.startswith("builtin:"):
        size_name = model.removeprefix("builtin:")
        size = BUILTIN_SIZES.get(size_name)
        if size is None:
            raise PolicyError(
                f"unknown built-in model size {size_name!r}; known: {', '.join(BUILTIN_SIZES)}"
            )
        tokenizer = build_tokenizer()
        tokenizer.model_max_length = size.context
        built = tiny_causal_lm(
            len(tokenizer) if vocab_size is None else vocab_size,
            hidden_size=size.hidden_size,
            layers=size.layers,
            heads=size.heads,
            kv_heads=size.kv_heads,
            context=size.context,
            seed=seed,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return Policy(built, tokenizer)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise PolicyError(
            f"model {model!r} is neither builtin:<size> nor a directory with a config.json "
            "(a Hugging Face causal LM saved with save_pretrained)"
        )
    if is_vision_language_folder(path):
        return _vision_language_policy(path)
    loaded: PreTrainedModel = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    loaded.train()
    tokenizer_found: PreTrainedTokenizerBase | None = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tokenizer_found = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Policy(loaded, tokenizer_found)


def _vision_language_policy(path: Path) -> Policy:
    """A vision-language model folder: the model, its processor, the vision encoder frozen."""
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)  # type: ignore[no-untyped-call]
    except (OSError, ValueError) as exc:
        raise PolicyError(
            f"model {str(path)!r} is a vision-language model without a processor it can load "
            f"({exc}); save its processor (processor.save_pretrained) into the folder"
        ) from None
    try:
        renderer = VisionChatRenderer(processor)
    except ChatFormatError as exc:
        raise PolicyError(f"model {str(path)!r}: {exc}") from None
    loaded: PreTrainedModel = AutoModelForImageTextToText.from_pretrained(
        path, local_files_only=True
    )
    loaded.train()
    try:
        frozen = freeze_vision_encoder(loaded)
    except ValueError as exc:
        raise PolicyError(f"model {str(path)!r}: {exc}") from None
    log.info(
        "vision-language policy %s: %s frozen (%d parameters), %d parameters train",
        path,
        ", ".join(frozen.encoders),
        frozen.frozen,
        frozen.trainable,
    )
    return Policy(
        loaded,
        renderer.tokenizer,
        processor=processor,
        vision=VisionInputs(renderer),
        frozen=frozen,
    )
