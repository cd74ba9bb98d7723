"""Where the policy's starting weights come from: a local Hugging Face model or one built in code.

`model` names are the `TrainingJobSpec.model` strings:

- `builtin:<size>` — a small Qwen2 model built from a config in code with seeded weights
  (`tiny`, `small`, and `tiny-32k`: tiny's shape with a 32,768-token context, enough for the
  12-23k tokens of system prompt and tool schemas real agent programs send), with Orchard's
  offline tokenizer (`orchard.lm.tokenizer`, the one the local inference engine uses), which
  reports the size's context as its `model_max_length`; nothing is downloaded;
- anything else — a local directory holding a Hugging Face causal LM (`config.json` and
  weights, and its tokenizer when it has one), loaded with `local_files_only`, so a missing
  file fails here instead of reaching for a hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from orchard.lm.models import tiny_causal_lm
from orchard.lm.tokenizer import build_tokenizer

__all__ = ["BUILTIN_SIZES", "BuiltinSize", "Policy", "PolicyError", "load_policy"]


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

    @property
    def pad_id(self) -> int:
        if self.tokenizer is not None and self.tokenizer.pad_token_id is not None:
            return int(self.tokenizer.pad_token_id)
        pad = getattr(self.model.config, "pad_token_id", None)
        return int(pad) if isinstance(pad, int) else 0


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
    loaded: PreTrainedModel = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    loaded.train()
    tokenizer_found: PreTrainedTokenizerBase | None = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tokenizer_found = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Policy(loaded, tokenizer_found)
