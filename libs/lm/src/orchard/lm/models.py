"""Causal LMs built from a config in code, so tests and demos never download weights."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM


def tiny_causal_lm(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    context: int = 256,
    seed: int = 0,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Qwen2ForCausalLM:
    """A small Qwen2-architecture model with random weights (about 0.1 M parameters by default).

    The seed fixes the initial weights, so two calls with the same arguments give the same model.
    The token ids, when given, go into the config (and so into a saved model folder).
    """
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def tiny_causal_lm_for(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    context: int = 1024,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """`tiny_causal_lm` sized for `tokenizer` (its whole vocabulary, added tokens included),
    with its bos, eos and pad ids in the config."""
    return tiny_causal_lm(
        len(tokenizer),
        hidden_size=hidden_size,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        context=context,
        seed=seed,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
