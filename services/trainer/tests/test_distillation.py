"""On-policy distillation through the DeepSpeed engine: each loss token's advantage is the
teacher's log-probability of the student's token minus the student's, computed here
independently; trajectories need no reward; steps lower the student's reverse KL."""

from __future__ import annotations

import copy

import pytest
import torch

from orchard.trainer.batch import TokenBatch, collate
from orchard.trainer.distillation import (
    DistillationConfig,
    TeacherMismatch,
    check_same_vocabulary,
    distillation_advantages,
    opd_update,
    teacher_logprobs,
)
from orchard.trainer.engine import EngineConfig, TrainingEngine
from orchard.trainer.policy import load_policy
from orchard.trainer.rl import RlConfig, build_rl_batch

VOCAB = 48
PROMPTS = [[1, 20, 21, 22, 2], [1, 23, 24, 2], [1, 25, 2]]
ACTIONS = [[30, 31, 3], [40, 41, 42, 3], [33, 3]]
OPD = RlConfig(require_reward=False, skip_zero_advantage=False)


def trajectories(build, *, logprobs=None, reward: float | None = 1.0):
    """Six trajectories of three tasks, all rewarded alike (GRPO would train on none)."""
    out = []
    for k in range(6):
        t = build(
            [build.Turn(inputs=PROMPTS[k % 3], outputs=ACTIONS[k % 3], logprobs=logprobs)],
            trajectory_id=f"t{k}",
            task_id=f"task{k % 3}",
            reward=reward,
        )
        t.rollout_id = f"r{k}"
        out.append(t)
    return out


def independent_logprobs(model: torch.nn.Module, tokens: TokenBatch) -> torch.Tensor:
    """Each target's log-probability, one row at a time without padding (no shared code)."""
    out = torch.zeros(tokens.targets.shape)
    with torch.no_grad():
        for row in range(tokens.input_ids.shape[0]):
            n = int(tokens.attention_mask[row].sum())
            logits = model(input_ids=tokens.input_ids[row : row + 1, :n]).logits[0].double()
            logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
            out[row, :n] = logp.gather(-1, tokens.targets[row, :n, None])[:, 0].float()
    return out


def frozen(seed: int) -> torch.nn.Module:
    model = load_policy("builtin:tiny", vocab_size=VOCAB, seed=seed).model
    model.train(False)
    return model


def test_advantages_are_teacher_minus_student_token_by_token(build):
    student, teacher = frozen(3), frozen(4)
    tokens = collate(build_rl_batch(trajectories(build), OPD).samples, pad_id=0)
    mask = tokens.loss_mask
    # The student's sampling logprobs: exactly its own, so the same model as teacher gives 0.
    own = independent_logprobs(student, tokens)
    same = distillation_advantages(
        teacher_logprobs(student, tokens, torch.device("cpu")), own, mask
    )
    assert same.shape == mask.shape
    assert same.abs().max() < 1e-5
    # Another teacher: coef x (its logprobs - the student's) on every loss token, 0 elsewhere.
    scored = teacher_logprobs(teacher, tokens, torch.device("cpu"))
    expected = independent_logprobs(teacher, tokens)
    torch.testing.assert_close(scored[mask], expected[mask], atol=1e-5, rtol=1e-5)
    advantages = distillation_advantages(scored, own, mask, coef=0.5)
    torch.testing.assert_close(advantages[mask], 0.5 * (expected - own)[mask], atol=1e-5, rtol=0)
    assert (advantages[~mask] == 0).all()
    assert advantages[mask].abs().min() > 0
    with pytest.raises(ValueError, match="coef must be a finite number above 0"):
        DistillationConfig(coef=0.0)


def test_opd_needs_no_reward_and_keeps_groups_whose_rewards_agree(build):
    rows = trajectories(build, reward=None)  # unscored
    rows += trajectories(build, reward=1.0)[:2]
    rows.append(
        build([build.Turn(inputs=[1, 2], outputs=[5, 3])], trajectory_id="x", excluded=True)
    )
    rows.append(build([build.Turn(inputs=[1, 2], outputs=[6, 3])], trajectory_id="y", aborted=True))
    for k, t in enumerate(rows[6:8]):
        t.id, t.rollout_id = f"scored{k}", f"scored-r{k}"
    grpo = build_rl_batch(rows)
    assert len(grpo.samples) == 0  # unscored, and scored groups whose rewards agree
    batch = build_rl_batch(rows, OPD)
    assert len(batch.samples) == 8
    assert batch.skipped == {"excluded": 1, "aborted": 1}
    assert batch.advantages == (0.0,) * 8
    assert batch.sampled == (True,) * 8
    assert not build_rl_batch(trajectories(build, logprobs=[]), OPD).sampled[0]


def engine_for(model: torch.nn.Module, steps: int) -> TrainingEngine:
    return TrainingEngine(
        model,
        EngineConfig(
            micro_batch_size=3, gradient_accumulation=2, learning_rate=0.01, total_steps=steps
        ),
    )


def sharp_teacher(seed: int, vocab_size: int | None = VOCAB) -> torch.nn.Module:
    """A tiny model SFT-trained (plain Adam, here) to answer each prompt with its action: far
    from a freshly seeded student, whose distributions are near uniform."""
    model = load_policy("builtin:tiny", vocab_size=vocab_size, seed=seed).model
    width = max(len(p) + len(a) for p, a in zip(PROMPTS, ACTIONS, strict=True))
    ids = torch.zeros((len(PROMPTS), width), dtype=torch.long)
    labels = torch.full((len(PROMPTS), width), -100, dtype=torch.long)
    for row, (prompt, action) in enumerate(zip(PROMPTS, ACTIONS, strict=True)):
        ids[row, : len(prompt) + len(action)] = torch.tensor(prompt + action)
        labels[row, len(prompt) : len(prompt) + len(action)] = torch.tensor(action)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    for _ in range(20):
        logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.train(False)
    model.requires_grad_(False)
    return model


def exact_reverse_kl(
    student: torch.nn.Module, teacher: torch.nn.Module, tokens: TokenBatch
) -> float:
    """KL(student || teacher) over the whole vocabulary, averaged over the loss positions."""
    was_training = student.training
    student.train(False)
    with torch.no_grad():
        s = torch.log_softmax(student(input_ids=tokens.input_ids).logits.double(), dim=-1)
        t = torch.log_softmax(teacher(input_ids=tokens.input_ids).logits.double(), dim=-1)
    student.train(was_training)
    return float((s.exp() * (s - t)).sum(-1)[tokens.loss_mask].mean())


def test_opd_steps_score_every_token_and_bring_the_student_to_the_teacher(build):
    """A fixed set of the teacher's answers without sampling logprobs: the student's are the
    current policy's, so each step's log-ratio is the current one; it shrinks step after step,
    and the student's exact reverse KL to the teacher falls."""
    student = load_policy("builtin:tiny", vocab_size=VOCAB, seed=3).model
    teacher = sharp_teacher(7)
    batch = build_rl_batch(trajectories(build, logprobs=[], reward=None), OPD)
    tokens = collate(batch.samples, pad_id=0)
    mask = tokens.loss_mask
    start_kl = exact_reverse_kl(student, teacher, tokens)
    student.train(False)
    start_ratio = independent_logprobs(student, tokens) - independent_logprobs(teacher, tokens)
    student.train()
    engine = engine_for(student, 6)
    try:
        ratios = []
        for _ in range(6):
            (result,) = opd_update(engine, teacher, batch, OPD, DistillationConfig(), pad_id=0)
            ratios.append(result.extra["distill_reverse_kl"])
            assert result.extra["distill_tokens"] == int(mask.sum())
            assert result.extra["distill_student_recomputed"] == len(batch.samples)
            assert {"advantage_mean", "clip_fraction", "entropy"} <= set(result.extra)
            # No sampling logprobs: the importance weight is 1, not exp(old - 0).
            assert result.extra["importance_mean"] == pytest.approx(1.0, abs=1e-5)
        end_kl = exact_reverse_kl(engine.module, teacher, tokens)
    finally:
        engine.close()
    assert ratios[0] == pytest.approx(float(start_ratio[mask].mean()), abs=1e-4)
    assert ratios[0] < -2.0  # the teacher is sure of tokens the student barely knows
    assert abs(ratios[-1]) < 0.6 * abs(ratios[0])
    assert start_kl > 3.0
    assert end_kl < 0.9 * start_kl


def test_a_teacher_that_is_the_student_gives_zero_advantages_and_no_gradient(build):
    student = load_policy("builtin:tiny", vocab_size=VOCAB, seed=3).model
    teacher = copy.deepcopy(student)
    teacher.train(False)
    batch = build_rl_batch(trajectories(build, logprobs=[]), OPD)
    engine = engine_for(student, 1)
    try:
        (result,) = opd_update(engine, teacher, batch, OPD, DistillationConfig(), pad_id=0)
    finally:
        engine.close()
    assert result.extra["distill_reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    assert result.extra["advantage_mean"] == pytest.approx(0.0, abs=1e-5)
    assert result.grad_norm == pytest.approx(0.0, abs=1e-5)


def test_a_teacher_with_another_vocabulary_is_refused():
    student = load_policy("builtin:tiny").tokenizer
    other = copy.deepcopy(student)
    assert student is not None and other is not None
    other.add_tokens(["<teacher-only>"])
    check_same_vocabulary(student, copy.deepcopy(student), teacher_name="same")
    with pytest.raises(TeacherMismatch, match="another vocabulary than the student") as caught:
        check_same_vocabulary(student, other, teacher_name="file:///t")
    assert "<teacher-only>" in str(caught.value)
