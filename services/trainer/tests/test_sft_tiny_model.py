"""A short SFT run of a tiny causal LM on synthetic trajectories, through the masks above.

The task: each trajectory shows four observation tokens; the policy's action is those tokens
shifted by one, then an end token. Observations are random, so the model can only lower the
masked loss by learning the action rule.
"""

from __future__ import annotations

import random

import pytest
import torch

from orchard.lm.models import tiny_causal_lm
from orchard.trainer.batch import collate
from orchard.trainer.losses import sft_loss, token_logprobs
from orchard.trainer.masks import SampleConfig, build_sft_samples

VOCAB = 48
BOS, SEP, END, PAD = 1, 2, 3, 0
FIRST = 10  # observation tokens are FIRST .. VOCAB - 2


def synthetic_trajectories(build, n: int, seed: int):
    rng = random.Random(seed)
    trajectories = []
    for k in range(n):
        obs = [rng.randrange(FIRST, VOCAB - 1) for _ in range(4)]
        action = [o + 1 for o in obs] + [END]
        # A failed first attempt (a rule as easy to learn: shift down) outside any rise
        # segment, then the right action inside one: only the right action may be learned.
        wrong = [o - 1 for o in obs]
        trajectories.append(
            build(
                [
                    build.Turn(inputs=[BOS, *obs, SEP], outputs=wrong),
                    build.Turn(inputs=[SEP], outputs=action),
                ],
                trajectory_id=f"t{k}",
                reward=0.0,
                rise=[(1, 1)],
            )
        )
    return trajectories


def exact_match(model, batch) -> float:
    """Fraction of samples whose every trained target is the greedy choice."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    right = (logits.argmax(-1) == batch.targets) | ~batch.loss_mask
    return float(right.all(dim=-1).float().mean())


@pytest.mark.slow
def test_sft_lowers_the_masked_loss_and_learns_the_actions(build):
    torch.manual_seed(0)
    # Held-out observations check that the rule was learned, not the examples.
    train = build_sft_samples(synthetic_trajectories(build, 512, seed=1), SampleConfig())
    held_out = build_sft_samples(synthetic_trajectories(build, 32, seed=2), SampleConfig())
    assert len(train.samples) == 512
    # Each sample trains on exactly the five tokens of the right action.
    assert all(s.loss_tokens == 5 for s in train.samples)
    test_batch = collate(held_out.samples, pad_id=PAD)

    model = tiny_causal_lm(VOCAB, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def loss_of(b):
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        return sft_loss(logits, b.targets, b.loss_mask)

    with torch.no_grad():
        start_loss = loss_of(test_batch).item()
    start_match = exact_match(model, test_batch)
    minibatches = [collate(train.samples[i : i + 64], pad_id=PAD) for i in range(0, 512, 64)]
    for step in range(100):
        optimizer.zero_grad()
        loss = loss_of(minibatches[step % len(minibatches)])
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        end_loss = loss_of(test_batch).item()
        logits = model(input_ids=test_batch.input_ids, attention_mask=test_batch.attention_mask)
        logp = token_logprobs(logits.logits, test_batch.targets)
    end_match = exact_match(model, test_batch)

    assert start_match == 0.0
    # Measured: held-out loss 3.85 -> 0.003, exact match 0.00 -> 1.00.
    assert end_loss < 0.25 * start_loss, (start_loss, end_loss)
    assert end_match >= 0.8, end_match
    # The wrong first attempts (targets 5..8) were masked: the model did not learn them.
    wrong_positions = torch.zeros_like(test_batch.loss_mask)
    wrong_positions[:, 5:9] = True
    wrong_probability = float(logp[wrong_positions].exp().mean())
    # Measured 0.017; trained on all turns instead (reward 1.0), the same run gives 0.98.
    assert wrong_probability < 0.2, wrong_probability
