"""No length normalization: an SFT step's loss is the mean over every loss token of the step,
so a long episode's tokens weigh as much as a short one's whatever micro-batches hold them."""

from __future__ import annotations

import pytest
import torch

from orchard.trainer.batch import collate
from orchard.trainer.engine import EngineConfig, TrainingEngine
from orchard.trainer.losses import token_logprobs
from orchard.trainer.masks import Sample
from orchard.trainer.policy import load_policy

VOCAB = 48


def sample(name: str, prompt: int, outputs: int, offset: int) -> Sample:
    tokens = tuple((offset + 3 * k) % (VOCAB - 1) + 1 for k in range(prompt + outputs))
    mask = (False,) * prompt + (True,) * outputs
    return Sample(name, tokens, mask, (0.0,) * len(tokens))


LONG = sample("long", prompt=6, outputs=40, offset=5)
SHORT = sample("short", prompt=6, outputs=2, offset=11)


def trained(
    micro_batches: list[list[Sample]],
) -> tuple[float, float, int, dict[str, torch.Tensor]]:
    """One SFT step over `micro_batches` (accumulated) from the same start: loss, gradient
    norm, loss tokens, weights after."""
    config = EngineConfig(
        micro_batch_size=max(len(m) for m in micro_batches),
        gradient_accumulation=len(micro_batches),
        learning_rate=1e-2,
        total_steps=1,
        gradient_clipping=0.0,
    )
    policy = load_policy("builtin:tiny", vocab_size=VOCAB, seed=3)
    with TrainingEngine(policy.model, config) as engine:
        result = engine.sft_step([collate(m, pad_id=0) for m in micro_batches])
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return result.loss, result.grad_norm, result.loss_tokens, weights


def test_a_long_episode_alone_in_its_micro_batch_is_not_down_weighted() -> None:
    model = load_policy("builtin:tiny", vocab_size=VOCAB, seed=3).model
    nll: list[torch.Tensor] = []
    with torch.no_grad():
        for s in (LONG, SHORT):
            batch = collate([s], pad_id=0)
            logp = token_logprobs(model(input_ids=batch.input_ids).logits, batch.targets)
            nll.append(-logp[batch.loss_mask])
    per_token = float(torch.cat(nll).mean())
    per_sequence = float((nll[0].mean() + nll[1].mean()) / 2)
    assert abs(per_token - per_sequence) > 1e-3  # the two weightings differ on these samples

    apart_loss, apart_norm, apart_tokens, apart = trained([[LONG], [SHORT]])
    together_loss, together_norm, together_tokens, together = trained([[LONG, SHORT]])
    assert apart_tokens == together_tokens == 42
    assert apart_loss == pytest.approx(per_token, rel=1e-5)
    assert together_loss == pytest.approx(per_token, rel=1e-5)
    # The same gradient, so the same update (Adam's first step moves each weight by about
    # 3 x lr; float noise on gradients near zero stays far below that).
    assert apart_norm == pytest.approx(together_norm, rel=1e-5)
    for name, value in together.items():
        torch.testing.assert_close(apart[name], value, rtol=0.0, atol=1e-4)
