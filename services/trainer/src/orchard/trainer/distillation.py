"""On-policy distillation: a teacher scores the student's own samples, token by token.

The student samples trajectories as in any RL job. For every loss token the teacher's
log-probability of exactly that token, in exactly the context the student saw, is compared
with the student's log-probability at sampling time; the advantage of the token is

    A_t = coef * (log p_teacher(x_t | x_<t) - log p_student(x_t | x_<t))

the negative of a one-sample estimate of the reverse KL from the student to the teacher at
that position. The same clipped policy loss as GRPO and PPO trains on these per-token
advantages (`rl.rl_update` with `advantages_of`, the path a value model's advantages take).
No reward is needed: an unscored trajectory trains, and a group whose rewards agree is not
dropped (`RlConfig(require_reward=False, skip_zero_advantage=False)`).

The teacher is a frozen model in the trainer's ranks (`load_teacher`: a built-in size or a
local model folder, loaded as the policy is): one forward pass per micro-batch without
gradient on the student's token ids (`teacher_logprobs`), the micro-batch exactly as the
policy's own forward pass gets it. The student's log-probabilities are the trajectories'
`output_logprobs`; a sample whose trajectory lacks them on a policy turn takes the current
policy's (`rl_update` fills them in before any step) and is counted in the step's
``distill_student_recomputed``.

Each step's metrics add ``distill_reverse_kl`` (the mean of student minus teacher
log-probability over the step's loss tokens: the reverse-KL estimate that training lowers),
``distill_tokens`` (loss tokens the teacher scored) and ``distill_student_recomputed``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from orchard.trainer.batch import TokenBatch
from orchard.trainer.engine import StepResult, TrainingEngine
from orchard.trainer.losses import token_logprobs
from orchard.trainer.policy import Policy, load_policy
from orchard.trainer.rl import RlBatch, RlConfig, rl_update

__all__ = [
    "DistillationConfig",
    "TeacherMismatch",
    "check_same_vocabulary",
    "distillation_advantages",
    "load_teacher",
    "opd_update",
    "teacher_logprobs",
]


@dataclass(frozen=True, slots=True)
class DistillationConfig:
    coef: float = 1.0
    """Scale of the teacher-minus-student log-ratio that is each token's advantage."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.coef) and self.coef > 0.0):
            raise ValueError(f"coef must be a finite number above 0, got {self.coef}")


class TeacherMismatch(ValueError):
    """A teacher whose token ids do not mean what the student's mean."""


def check_same_vocabulary(
    student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase, *, teacher_name: str
) -> None:
    """Raise `TeacherMismatch` unless both tokenizers map the same strings to the same ids."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine == theirs:
        return
    differing = sorted(
        (k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)),
        key=lambda k: min(mine.get(k, math.inf), theirs.get(k, math.inf)),
    )
    shown = ", ".join(
        f"{k!r}: {mine.get(k, 'absent')} vs {theirs.get(k, 'absent')}" for k in differing[:3]
    )
    raise TeacherMismatch(
        f"spec.distillation.teacher {teacher_name!r} has another vocabulary than the student "
        f"({len(mine)} vs {len(theirs)} tokens, {len(differing)} differ, e.g. {shown}): the "
        "log-ratio compares both models on the student's token ids, so the teacher needs the "
        "student's tokenizer"
    )


def load_teacher(model: str, *, seed: int, student: Policy) -> PreTrainedModel:
    """The frozen teacher `model` names (as `policy.load_policy` reads it: a built-in size
    from `seed`, or a local model folder), checked against the student's tokenizer."""
    teacher = load_policy(model, seed=seed)
    if teacher.vision is not None:
        raise TeacherMismatch(
            f"spec.distillation.teacher {model!r} is a vision-language model; only text "
            "teachers score tokens for now"
        )
    if teacher.tokenizer is None or student.tokenizer is None:
        raise TeacherMismatch(
            f"spec.distillation.teacher {model!r} has no tokenizer to check its vocabulary "
            "against the student's; save the student's tokenizer into its folder"
        )
    check_same_vocabulary(student.tokenizer, teacher.tokenizer, teacher_name=model)
    if teacher.vocab_size < len(student.tokenizer):
        raise TeacherMismatch(
            f"spec.distillation.teacher {model!r} has {teacher.vocab_size} output logits, fewer "
            f"than the {len(student.tokenizer)} tokens of the shared tokenizer"
        )
    frozen = teacher.model
    frozen.train(False)  # no dropout: its logprobs are the targets
    frozen.requires_grad_(False)
    return frozen


def teacher_logprobs(
    teacher: PreTrainedModel, tokens: TokenBatch, device: torch.device
) -> torch.Tensor:
    """`[batch, tokens]`: the teacher's log-probability of each target of `tokens`, without
    gradient. The forward pass is the policy's (`TrainingEngine.logits`): the right-padded
    input ids alone under causal attention, so a real token's context is the same."""
    with torch.no_grad():
        logits = teacher(input_ids=tokens.input_ids.to(device)).logits
        return token_logprobs(logits, tokens.targets.to(device)).float()


def distillation_advantages(
    teacher: torch.Tensor, student: torch.Tensor, mask: torch.Tensor, *, coef: float = 1.0
) -> torch.Tensor:
    """`[batch, tokens]`: coef x (teacher - student) on the loss tokens, 0 elsewhere."""
    if teacher.shape != student.shape or teacher.shape != mask.shape:
        raise ValueError(
            f"teacher {tuple(teacher.shape)}, student {tuple(student.shape)} and mask "
            f"{tuple(mask.shape)} log-probabilities must have the same shape"
        )
    ratio = teacher.float() - student.float().to(teacher.device)
    return torch.where(mask.bool().to(teacher.device), coef * ratio, 0.0)


def opd_update(
    engine: TrainingEngine,
    teacher: PreTrainedModel,
    batch: RlBatch,
    config: RlConfig,
    distillation: DistillationConfig,
    *,
    pad_id: int,
    reference: PreTrainedModel | None = None,
) -> list[StepResult]:
    """`rl.rl_update` with the teacher's per-token advantages; each step's metrics carry the
    distillation numbers of its micro-batches, summed over the ranks."""
    # Per micro-batch, in the order rl_update builds them: (sum of student - teacher over the
    # loss tokens, loss tokens, samples whose student log-probabilities were recomputed).
    sums: list[tuple[float, float, float]] = []

    def advantages_of(tokens: TokenBatch, piece: range) -> torch.Tensor:
        device = engine.device
        scored = teacher_logprobs(teacher, tokens, device)
        # Sampling logprobs, or the current policy's where the trajectory had none (rl_update
        # fills those rows in before it asks for advantages).
        student = tokens.rollout_logprobs.to(device)
        mask = tokens.loss_mask.to(device).bool()
        recomputed = sum(1 for i in piece if batch.sampled and not batch.sampled[i])
        sums.append((float((student - scored)[mask].sum()), float(mask.sum()), float(recomputed)))
        return distillation_advantages(scored, student, mask, coef=distillation.coef)

    advantages: Callable[[TokenBatch, range], torch.Tensor] = advantages_of
    results = rl_update(
        engine, batch, config, pad_id=pad_id, reference=reference, advantages_of=advantages
    )
    accumulation = engine.config.gradient_accumulation
    out = []
    for update, result in enumerate(results):
        chunk = sums[update * accumulation : (update + 1) * accumulation]
        totals = torch.tensor([sum(c[k] for c in chunk) for k in range(3)], dtype=torch.float64)
        if engine.world_size > 1:
            torch.distributed.all_reduce(totals)
        log_ratio, tokens, recomputed = totals.tolist()
        extra = {
            **result.extra,
            "distill_reverse_kl": log_ratio / tokens if tokens else 0.0,
            "distill_tokens": tokens,
            "distill_student_recomputed": recomputed,
        }
        out.append(replace(result, extra=extra))
    return out
