"""The DeepSpeed training engine: one optimizer step over micro-batches, with its metrics.

`TrainingEngine` wraps `deepspeed.initialize` around a causal LM with a torch AdamW optimizer
(DeepSpeed's own fused and CPU Adam compile C++ for a minute on first use; the torch one needs
nothing) and a cosine learning-rate schedule with linear warmup. ZeRO stage 0-3, gradient
accumulation and gradient clipping are DeepSpeed's; bf16 is used where the hardware has it.

One call of `step(micro_batches, loss_fn)` runs `gradient_accumulation` micro-batches on this
rank (forward, loss, backward) and then one optimizer step; in a world of several processes
each rank passes its own micro-batches and DeepSpeed averages the gradients. The loss of a step
is the mean of its micro-batch losses over all ranks, which is also what the gradient is of,
so a world of two with accumulation g and a world of one with accumulation 2g see the same
numbers on the same micro-batches.

A per-token loss (SFT's negative log-likelihood; the policy loss without length
normalization) is weighted by tokens over the whole step (`step(..., token_weighted=True)`):
each micro-batch's mean is scaled by its share of the step's loss tokens on all ranks, so the
step's loss is the mean over every loss token of the step. No sequence is normalized by its own
length: a long episode's tokens count as much as a short one's, whatever the micro-batches
hold (with a plain mean of micro-batch means, a micro-batch of one long episode would weigh as
much as one of a short episode, each of its tokens less).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, get_cosine_schedule_with_warmup

from orchard.trainer.batch import TokenBatch
from orchard.trainer.distributed import ProcessGroupSpec, import_deepspeed, init_process_group
from orchard.trainer.losses import sft_loss_and_logp, token_entropy, token_logprobs

__all__ = [
    "EngineConfig",
    "LossFn",
    "Precision",
    "StepResult",
    "TrainingEngine",
    "ValidationLoss",
    "bf16_available",
    "deepspeed_config",
]


class Precision(enum.StrEnum):
    """Number format of the weights and activations during training."""

    AUTO = "auto"
    """bf16 where the accelerator supports it (a CUDA device with bf16), fp32 otherwise."""
    FP32 = "fp32"
    BF16 = "bf16"


def bf16_available() -> bool:
    """Whether this machine's accelerator trains in bf16 at full speed."""
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine optimizes: ZeRO stage, batch shape, schedule, precision."""

    zero_stage: int = 0
    """DeepSpeed ZeRO stage: 0 (plain data parallel) to 3 (parameters partitioned too)."""
    micro_batch_size: int = 8
    """Sequences per forward pass on one rank."""
    gradient_accumulation: int = 1
    """Micro-batches per rank per optimizer step."""
    learning_rate: float = 1e-4
    """Peak learning rate, reached at the end of warmup."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `learning_rate`."""
    total_steps: int = 1000
    """Steps of the whole schedule; the cosine reaches 0 here."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    gradient_clipping: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    precision: Precision = Precision.AUTO
    seed: int = 0
    load_universal: bool = False
    """Build the engine to load a DeepSpeed universal checkpoint (one converted from a world
    of another size: `checkpoints.load_checkpoint` converts)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision(self.precision))
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.micro_batch_size < 1 or self.gradient_accumulation < 1:
            raise ValueError("micro_batch_size and gradient_accumulation must be at least 1")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.total_steps < 1 or not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"need total_steps >= 1 and 0 <= warmup_steps <= total_steps, got "
                f"warmup_steps={self.warmup_steps}, total_steps={self.total_steps}"
            )
        if self.gradient_clipping < 0:
            raise ValueError(f"gradient_clipping must be >= 0, got {self.gradient_clipping}")

    @property
    def dtype(self) -> torch.dtype:
        """The training dtype `precision` resolves to on this machine."""
        if self.precision is Precision.BF16 or (
            self.precision is Precision.AUTO and bf16_available()
        ):
            return torch.bfloat16
        return torch.float32


def deepspeed_config(config: EngineConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed configuration dictionary for `config` in a world of `world_size`."""
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.zero_stage == 3:
        # Gather the whole model for saving; small models need no prefetch tuning.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation,
        "train_batch_size": config.micro_batch_size * config.gradient_accumulation * world_size,
        "gradient_clipping": config.gradient_clipping,
        "zero_optimization": zero,
        # A torch optimizer under ZeRO is supported, only not in DeepSpeed's own test matrix.
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": config.dtype == torch.bfloat16},
        "checkpoint": {"load_universal": config.load_universal},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


LossFn = Callable[[torch.Tensor, TokenBatch], tuple[torch.Tensor, dict[str, float]]]
"""(logits, micro-batch) -> (loss, statistics to average over the step)."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one optimizer step did, summed or averaged over all ranks."""

    step: int
    """Optimizer steps taken so far, this one included."""
    loss: float
    learning_rate: float
    """The rate this step used."""
    grad_norm: float
    """Global gradient norm before clipping."""
    loss_tokens: int
    """Target tokens that counted in the loss."""
    tokens: int
    """Tokens processed (real tokens, no padding)."""
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)
    """Loss statistics (entropy, clip fractions, importance weights...), averaged."""
    validation: ValidationLoss | None = None
    """The validation loss evaluated after this step (SFT jobs with a validation set)."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ValidationLoss:
    """The SFT loss of a validation set under the current weights, over all ranks."""

    loss: float
    """Mean negative log-likelihood per loss token (NaN when no token counted)."""
    loss_tokens: int
    epoch: float = 0.0
    """Passes over the training samples made when it was evaluated."""


def sft_step_loss(logits: torch.Tensor, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """The SFT loss of one micro-batch, and the policy's entropy on its loss tokens (from the
    loss's own log-softmax: one softmax over the vocabulary serves both)."""
    loss, logp = sft_loss_and_logp(logits, batch.targets, batch.loss_mask)
    if logp.numel() == 0:
        return loss, {"entropy": 0.0}
    with torch.no_grad():
        logp = logp.detach()
        entropy = float(-(logp.exp() * logp).sum(dim=-1).mean())
    return loss, {"entropy": entropy}


def masked_entropy(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean entropy (nats) of the next-token distribution at the loss positions."""
    with torch.no_grad():
        selected = mask.bool()
        if not bool(selected.any()):
            return 0.0
        # Only the loss positions: the softmax over the vocabulary is most of the cost.
        return float(token_entropy(logits[selected]).mean())


class TrainingEngine:
    """A causal LM under DeepSpeed; `close()` releases the engine (the process group stays)."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: EngineConfig,
        *,
        process_group: ProcessGroupSpec | None = None,
    ) -> None:
        init_process_group(process_group)
        deepspeed = import_deepspeed()
        torch.manual_seed(config.seed)
        self.config = config
        self.world_size = torch.distributed.get_world_size()
        self.rank = torch.distributed.get_rank()
        if model.dtype != config.dtype:
            model = torch.nn.Module.to(model, config.dtype)
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=config.learning_rate,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )

        def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
            # Built on the optimizer DeepSpeed hands back (ZeRO wraps the torch one).
            scheduler: torch.optim.lr_scheduler.LRScheduler = get_cosine_schedule_with_warmup(
                opt, config.warmup_steps, config.total_steps
            )
            return scheduler

        engine, _, _, scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=schedule,
            config=deepspeed_config(config, self.world_size),
            dist_init_required=False,
        )
        self.engine = engine
        self._scheduler = scheduler
        self._closed = False

    @property
    def module(self) -> PreTrainedModel:
        """The model itself (under ZeRO-3 its parameters are partitioned; see `full_state`)."""
        module: PreTrainedModel = self.engine.module
        return module

    @property
    def device(self) -> torch.device:
        return torch.device(self.engine.device)

    @property
    def global_step(self) -> int:
        return int(self.engine.global_steps)

    @property
    def learning_rate(self) -> float:
        """The rate the next optimizer step will use."""
        return float(self.engine.get_lr()[0])

    def _to_device(self, batch: TokenBatch) -> TokenBatch:
        device = self.device
        dtype = self.config.dtype
        return TokenBatch(
            input_ids=batch.input_ids.to(device),
            attention_mask=batch.attention_mask.to(device),
            targets=batch.targets.to(device),
            loss_mask=batch.loss_mask.to(device),
            rollout_logprobs=batch.rollout_logprobs.to(device),
            # Pixel values in the weights' dtype (a bf16 vision tower takes no float32).
            model_inputs={
                key: value.to(device, dtype) if value.is_floating_point() else value.to(device)
                for key, value in batch.model_inputs.items()
            },
        )

    def logits(self, batch: TokenBatch) -> torch.Tensor:
        """Logits of `batch` through the engine (with gradients when training).

        Batches are right-padded (`collate`) and attention is causal, so no real token ever
        attends to padding and the mask is left out: given one, the model would build a full
        tokens x tokens mask per row (5 GiB for 16k + 8k tokens) where without it attention
        stays linear in memory; the logits of real tokens are the same. A vision-language
        student's batch adds its images' inputs (`TokenBatch.model_inputs`)."""
        out = self.engine(input_ids=batch.input_ids, **batch.model_inputs)
        logits: torch.Tensor = out.logits
        return logits

    def target_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Log-probability of each target under the current weights, without gradients."""
        batch = self._to_device(batch)
        was_training = self.engine.training
        self.engine.eval()
        try:
            with torch.no_grad():
                return token_logprobs(self.logits(batch), batch.targets).float()
        finally:
            self.engine.train(was_training)

    def step(
        self,
        micro_batches: Sequence[TokenBatch],
        loss_fn: LossFn | Sequence[LossFn],
        *,
        token_weighted: bool = False,
    ) -> StepResult:
        """Forward, backward and one optimizer step over this rank's micro-batches.

        `loss_fn` is one function for all micro-batches, or one per micro-batch (when each
        carries numbers of its own, such as old log-probabilities and advantages).
        `token_weighted`: each loss is a mean over its micro-batch's loss tokens, and the step
        weighs micro-batches by those tokens (see the module docstring); otherwise every
        micro-batch weighs the same.
        """
        if len(micro_batches) != self.config.gradient_accumulation:
            raise ValueError(
                f"a step takes gradient_accumulation={self.config.gradient_accumulation} "
                f"micro-batches per rank, got {len(micro_batches)}"
            )
        loss_fns = [loss_fn] * len(micro_batches) if callable(loss_fn) else list(loss_fn)
        if len(loss_fns) != len(micro_batches):
            raise ValueError(f"{len(loss_fns)} loss functions for {len(micro_batches)} batches")
        started = time.perf_counter()
        learning_rate = self.learning_rate
        shares = self._token_shares(micro_batches) if token_weighted else None
        self.engine.train()
        loss_sum = 0.0
        loss_tokens = 0
        tokens = 0
        extras: dict[str, list[float]] = {}
        measured_norm = math.nan
        for k, (raw, fn) in enumerate(zip(micro_batches, loss_fns, strict=True)):
            batch = self._to_device(raw)
            loss, stats = fn(self.logits(batch), batch)
            if shares is not None:
                loss = loss * shares[k]
            self.engine.backward(loss)
            if k == len(micro_batches) - 1 and self.config.zero_stage == 0:
                # Stage 0 keeps no global norm; the gradients are reduced by now.
                measured_norm = _grad_norm_of(self.engine.module)
            self.engine.step()
            loss_sum += float(loss.detach())
            loss_tokens += int(batch.loss_mask.sum())
            tokens += int(batch.attention_mask.sum())
            for key, value in stats.items():
                extras.setdefault(key, []).append(value)
        grad_norm = measured_norm if self.config.zero_stage == 0 else self._grad_norm()
        counts = torch.tensor(
            [loss_sum, float(len(micro_batches)), float(loss_tokens), float(tokens)],
            dtype=torch.float64,
        )
        reduced_extra = {
            key: _reduce_stat(key, values, self.world_size) for key, values in extras.items()
        }
        if self.world_size > 1:
            torch.distributed.all_reduce(counts)
        loss_sum, n, loss_tokens_f, tokens_f = counts.tolist()
        return StepResult(
            step=self.global_step,
            loss=loss_sum / n,
            learning_rate=learning_rate,
            grad_norm=grad_norm,
            loss_tokens=round(loss_tokens_f),
            tokens=round(tokens_f),
            seconds=time.perf_counter() - started,
            extra=reduced_extra,
        )

    def _token_shares(self, micro_batches: Sequence[TokenBatch]) -> list[float]:
        """Each micro-batch's weight when every loss token of the step (all ranks) counts the
        same: its loss tokens x micro-batches on all ranks / the step's loss tokens. DeepSpeed
        divides each backward by the accumulation steps and averages gradients over ranks, so
        the gradient is that of the mean over the step's loss tokens."""
        counts = [float(b.loss_mask.sum()) for b in micro_batches]
        total = torch.tensor([sum(counts)], dtype=torch.float64)
        if self.world_size > 1:
            torch.distributed.all_reduce(total)
        pieces = len(micro_batches) * self.world_size
        return [n * pieces / max(float(total.item()), 1.0) for n in counts]

    def sft_step(self, micro_batches: Sequence[TokenBatch]) -> StepResult:
        """One SFT optimizer step: the negative log-likelihood of the policy tokens, a mean
        over every loss token of the step (no sequence normalized by its own length)."""
        return self.step(micro_batches, sft_step_loss, token_weighted=True)

    def sft_validation(self, micro_batches: Sequence[TokenBatch]) -> ValidationLoss:
        """The SFT loss of `micro_batches` (the whole validation set, the same on every rank)
        under the current weights, without gradients and with dropout off: the same masked
        negative log-likelihood as `sft_step`, averaged over every loss token. Each rank
        evaluates every `world_size`-th micro-batch and the sums are reduced; ranks run the
        same number of forward passes (ZeRO-3 gathers parameters in each), a rank short of
        micro-batches running one that it does not count."""
        if not micro_batches:
            raise ValueError("no validation micro-batch to evaluate")
        rounds = math.ceil(len(micro_batches) / self.world_size)
        totals = torch.zeros(2, dtype=torch.float64)
        was_training = self.engine.training
        self.engine.eval()
        try:
            with torch.no_grad():
                for k in range(rounds):
                    index = k * self.world_size + self.rank
                    counted = index < len(micro_batches)
                    batch = self._to_device(micro_batches[index if counted else 0])
                    loss, _ = sft_loss_and_logp(self.logits(batch), batch.targets, batch.loss_mask)
                    tokens = int(batch.loss_mask.sum())
                    if counted and tokens:
                        totals += torch.tensor([float(loss) * tokens, float(tokens)])
        finally:
            self.engine.train(was_training)
        if self.world_size > 1:
            torch.distributed.all_reduce(totals)
        nll, tokens = totals.tolist()
        return ValidationLoss(loss=nll / tokens if tokens else math.nan, loss_tokens=round(tokens))

    def _grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return math.nan
        return float(norm.item() if isinstance(norm, torch.Tensor) else norm)

    def close(self) -> None:
        """Free the engine's buffers and hooks; idempotent."""
        if self._closed:
            return
        self._closed = True
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None:
            destroy()

    def __enter__(self) -> TrainingEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _grad_norm_of(module: torch.nn.Module) -> float:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return math.nan
    return float(torch.nn.utils.get_total_norm(grads))


def _reduce_stat(key: str, values: list[float], world_size: int) -> float:
    """Combine one statistic over micro-batches and ranks: min, max, or mean by its name."""
    if key.endswith("_min"):
        local, op = min(values), torch.distributed.ReduceOp.MIN
    elif key.endswith("_max"):
        local, op = max(values), torch.distributed.ReduceOp.MAX
    else:
        local, op = sum(values) / len(values), torch.distributed.ReduceOp.SUM
    if world_size == 1:
        return local
    value = torch.tensor([local], dtype=torch.float64)
    torch.distributed.all_reduce(value, op=op)
    result = float(value.item())
    return result / world_size if op == torch.distributed.ReduceOp.SUM else result
