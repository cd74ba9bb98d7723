"""Samples padded into tensors, shifted so that position t predicts target t.

A causal LM's logits at position i predict token i + 1, so a sample of n tokens gives n - 1
targets: `input_ids` is tokens[:-1], `targets` is tokens[1:], and `loss_mask` and
`rollout_logprobs` are shifted with the targets. Padding is on the right and never in a mask.
A vision-language student's batch also carries the model inputs of its images
(`model_inputs`: ``pixel_values`` and the like, `orchard.trainer.vision`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from orchard.trainer.masks import Sample


@dataclass(frozen=True, slots=True)
class TokenBatch:
    input_ids: torch.Tensor
    """`[batch, tokens]`, int64."""
    attention_mask: torch.Tensor
    """`[batch, tokens]`, 1 for real tokens, 0 for padding."""
    targets: torch.Tensor
    """`[batch, tokens]`, the next token at each position (pad id past the end)."""
    loss_mask: torch.Tensor
    """`[batch, tokens]`, bool: the target counts in the loss."""
    rollout_logprobs: torch.Tensor
    """`[batch, tokens]`, float32: the sampling policy's log-probability of each target."""
    model_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Further inputs of the model's forward pass, by argument name: the pixel values of a
    vision-language student's images (empty for text)."""


def collate(samples: Sequence[Sample], pad_id: int) -> TokenBatch:
    """Pad samples (each at least 2 tokens) into one right-padded batch."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    width = max(len(s.token_ids) for s in samples) - 1
    shape = (len(samples), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    targets = torch.full(shape, pad_id, dtype=torch.long)
    attention = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    logprobs = torch.zeros(shape, dtype=torch.float32)
    for row, sample in enumerate(samples):
        n = len(sample.token_ids) - 1
        if n < 1:
            raise ValueError(f"sample of trajectory {sample.trajectory_id!r} has under 2 tokens")
        tokens = torch.tensor(sample.token_ids, dtype=torch.long)
        input_ids[row, :n] = tokens[:-1]
        targets[row, :n] = tokens[1:]
        attention[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
        logprobs[row, :n] = torch.tensor(sample.rollout_logprobs[1:], dtype=torch.float32)
    return TokenBatch(input_ids, attention, targets, loss_mask, logprobs)
