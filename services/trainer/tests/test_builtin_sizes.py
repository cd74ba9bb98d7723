"""The built-in model sizes: their shapes, one tokenizer for all (so any size can be another's
teacher), and weights fixed by the seed."""

from __future__ import annotations

import pytest
import torch

from orchard.trainer.policy import BUILTIN_SIZES, load_policy


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("size", "low", "high"),
    [("tiny", 0.1e6, 0.3e6), ("small", 0.5e6, 1.5e6), ("medium", 3e6, 8e6), ("large", 15e6, 25e6)],
)
def test_each_size_has_its_shape(size: str, low: float, high: float) -> None:
    policy = load_policy(f"builtin:{size}", seed=0)
    shape = BUILTIN_SIZES[size]
    config = policy.model.config
    assert (config.hidden_size, config.num_hidden_layers) == (shape.hidden_size, shape.layers)
    assert low <= _parameters(policy.model) <= high
    assert policy.tokenizer.model_max_length == shape.context


def test_every_size_shares_the_tokenizer_and_the_seed_fixes_the_weights() -> None:
    medium = load_policy("builtin:medium", seed=3)
    tiny = load_policy("builtin:tiny", seed=3)
    assert medium.tokenizer.get_vocab() == tiny.tokenizer.get_vocab()
    assert medium.model.config.vocab_size == tiny.model.config.vocab_size
    again = load_policy("builtin:medium", seed=3)
    other = load_policy("builtin:medium", seed=4)
    first = next(medium.model.parameters())
    assert torch.equal(first, next(again.model.parameters()))
    assert not torch.equal(first, next(other.model.parameters()))
