"""One rank of a job's worker group: a process of its own that holds the model and trains.

The trainer service (the controller, `orchard.trainer.workers`) starts one of these per rank
with ``python -m orchard.trainer.rank --conn-fd FD``. The first message on that connection is
the rank's `RankSetup`; the rank joins the torch.distributed group (gloo on CPU, NCCL with
CUDA), loads the policy, builds its DeepSpeed engine, restores a checkpoint when resuming and
answers ``("ok", RankReady)``. From then on it runs commands, one at a time, every rank the
same command: ``(name, arguments)`` in, ``("ok", value)`` or ``("error", RankFault)`` out.
Every rank keeps the whole data buffer and trains on its own share of each step's
micro-batches; the controller reads rank 0's answer. An SFT job's validation set is kept whole
by every rank too; after the steps `validation.evaluation_due` names, each rank evaluates its
share of it (`TrainingEngine.sft_validation`) and the step's result carries the loss.

An RL job with ADVANTAGE_ESTIMATOR_CRITIC holds a second engine, the value model
(`critic.build_critic`: the policy's trunk, a zero value head; its own optimizer and schedule,
`critic_engine_config`), built before the policy's engine partitions anything. Its first Step
runs `critic.value_pretrain` on the Step's batch before `critic.ppo_update`; checkpoints save
the value model beside the policy and a resume restores it (no second pretraining then).
An RL job whose `policy_loss.kl_coef` is above 0 also holds a frozen copy of its starting policy,
the reference its KL penalty measures the policy against (the same copy after a resume).
An RL job with ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION holds its frozen teacher
(`distillation.load_teacher`, checked against the student's tokenizer) and every Step is
`distillation.opd_update`; its buffer keeps unscored trajectories and groups whose rewards agree.

The rank never touches the artifact store: the controller hands it local folders (model,
dataset, checkpoint to resume from) and uploads what it saves. A rank exits when the
connection closes, when told to, or when the controller process is gone.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import shutil
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from orchard.core.success import DEFAULT_SUCCESS_THRESHOLD
from orchard.trainer.batch import TokenBatch
from orchard.trainer.checkpoints import (
    CRITIC_DIR,
    CheckpointError,
    CheckpointInfo,
    load_checkpoint,
    load_critic,
    read_checkpoint,
    saved_world_size,
    to_universal,
)
from orchard.trainer.checkpoints import save_checkpoint as save_engine_checkpoint
from orchard.trainer.critic import CriticConfig, build_critic, ppo_update, value_pretrain
from orchard.trainer.datasets import parse_trajectories
from orchard.trainer.distillation import DistillationConfig, load_teacher, opd_update
from orchard.trainer.distributed import ProcessGroupSpec
from orchard.trainer.engine import EngineConfig, StepResult, TrainingEngine
from orchard.trainer.losses import PolicyLossConfig
from orchard.trainer.masks import Overflow, Sample, SampleConfig, TrajectoryError
from orchard.trainer.microbatches import MicroBatchPlan
from orchard.trainer.policy import Policy, load_policy
from orchard.trainer.rl import RlBatch, RlConfig, StaleBatchError, StalePolicy, build_rl_batch
from orchard.trainer.rl import rl_update as run_rl_update
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.trainer.validation import evaluation_due
from orchard.types.v1 import trajectory_pb2

__all__ = [
    "RankFault",
    "RankReady",
    "RankSetup",
    "RankTrainer",
    "SubmitCounts",
    "critic_config",
    "critic_engine_config",
    "distillation_config",
    "main",
]

log = logging.getLogger(__name__)


class NotEnoughData(Exception):
    """A step was asked for before enough data was submitted."""


@dataclass(frozen=True, slots=True)
class RankSetup:
    """What one rank needs to start; the controller sends it first."""

    job_id: str
    spec: bytes
    """The resolved `TrainingJobSpec`, serialized."""
    model: str
    """``builtin:<size>`` or a local Hugging Face model folder."""
    scratch: str
    """A local folder of the job: checkpoints are written under ``<scratch>/saving``."""
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    dataset: str | None = None
    """A local JSON Lines copy of the spec's dataset (SFT), without held-out tasks."""
    validation_dataset: str | None = None
    """A local JSON Lines copy of the validation set (SFT with `spec.validation`)."""
    dataset_name: str = ""
    """The dataset's URL, for messages."""
    resume_from: str | None = None
    """A local checkpoint folder to restore."""
    teacher: str | None = None
    """On-policy distillation: ``builtin:<size>`` or a local folder of the teacher model."""
    threads: int = 0
    """torch CPU threads of this rank; 0 leaves torch's default."""


@dataclass(frozen=True, slots=True)
class RankReady:
    """A rank's answer to its setup."""

    pid: int
    step: int
    """Optimizer steps taken (after a resume, the checkpoint's)."""
    buffered: int
    """Samples buffered (an SFT dataset's)."""
    validation_samples: int = 0
    """Samples of the validation set."""


@dataclass(frozen=True, slots=True)
class SubmitCounts:
    groups: int = 0
    trainable: int = 0
    skipped: int = 0
    skip_reasons: Counter[str] | None = None


@dataclass(frozen=True, slots=True)
class RankFault:
    """An exception raised in a rank, carried across the process boundary by kind."""

    kind: str
    """`NotEnoughData`, `StaleBatchError`, `TrajectoryError`, `ValueError`, `CheckpointError`,
    or `other` (a bug or a broken rank)."""
    message: str
    trace: str = ""

    @classmethod
    def of(cls, exc: BaseException) -> RankFault:
        for kind in (NotEnoughData, StaleBatchError, TrajectoryError, CheckpointError):
            if isinstance(exc, kind):
                return cls(kind.__name__, str(exc))
        if isinstance(exc, ValueError):
            return cls("ValueError", str(exc))
        return cls("other", f"{type(exc).__name__}: {exc}", traceback.format_exc())


def sample_config(spec: api.TrainingJobSpec) -> SampleConfig:
    return SampleConfig(
        context_window=spec.max_sequence_tokens or None,
        overflow=Overflow.DROP if spec.drop_long else Overflow.TRUNCATE_LEFT,
        success_threshold=(
            spec.success_threshold
            if spec.HasField("success_threshold")
            else DEFAULT_SUCCESS_THRESHOLD
        ),
    )


def policy_loss_config(spec: api.TrainingJobSpec) -> PolicyLossConfig:
    loss = spec.policy_loss
    return PolicyLossConfig(
        clip_low=loss.clip_low,
        clip_high=loss.clip_high,
        importance_cap=loss.importance_cap,
        kl_coef=loss.kl_coef,
        length_normalization=loss.length_normalize,
    )


def engine_config(spec: api.TrainingJobSpec) -> EngineConfig:
    """The engine settings of a resolved spec."""
    return EngineConfig(
        zero_stage=spec.zero_stage,
        micro_batch_size=spec.micro_batch_size,
        gradient_accumulation=spec.gradient_accumulation,
        learning_rate=spec.learning_rate,
        warmup_steps=spec.warmup_steps,
        total_steps=spec.total_steps,
        seed=spec.seed,
    )


def critic_config(spec: api.TrainingJobSpec) -> CriticConfig | None:
    """The value model's settings of a spec; None unless it is RL with
    ADVANTAGE_ESTIMATOR_CRITIC. Unset fields take `CriticConfig`'s defaults; raises
    `ValueError` for values out of range."""
    if spec.mode != api.TRAINING_MODE_RL or (
        spec.advantage_estimator != api.ADVANTAGE_ESTIMATOR_CRITIC
    ):
        return None
    c, default = spec.critic, CriticConfig()
    clip = c.value_clip if c.HasField("value_clip") else default.value_clip
    return CriticConfig(
        gamma=c.gamma if c.HasField("gamma") else default.gamma,
        lam=c.gae_lambda if c.HasField("gae_lambda") else default.lam,
        value_clip=clip or None,
        steps_per_update=c.steps_per_update or default.steps_per_update,
    )


def distillation_config(spec: api.TrainingJobSpec) -> DistillationConfig | None:
    """The teacher's settings of a spec; None unless it is RL with
    ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION. Raises `ValueError` for a bad coefficient."""
    if spec.mode != api.TRAINING_MODE_RL or (
        spec.advantage_estimator != api.ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION
    ):
        return None
    d = spec.distillation
    return DistillationConfig(coef=d.coef if d.HasField("coef") else DistillationConfig().coef)


def critic_engine_config(spec: api.TrainingJobSpec) -> EngineConfig:
    """The value model's engine settings: the policy's ZeRO stage and batch shape, its own
    learning rate, and a cosine schedule without warmup over every value-model step the job
    can take (pretraining, then `steps_per_update` per policy step)."""
    c = spec.critic
    per_update = c.steps_per_update or CriticConfig().steps_per_update
    return replace(
        engine_config(spec),
        learning_rate=c.learning_rate or spec.learning_rate,
        warmup_steps=0,
        total_steps=c.value_pretrain_steps + spec.total_steps * per_update,
    )


class RankTrainer:
    """The policy, its engine, the value model's engine (PPO with a critic) and the data
    buffer of one rank (see the module docstring)."""

    def __init__(self, setup: RankSetup) -> None:
        spec = api.TrainingJobSpec.FromString(setup.spec)
        self.setup = setup
        self.spec = spec
        self.mode = "sft" if spec.mode == api.TRAINING_MODE_SFT else "rl"
        if setup.threads > 0:
            torch.set_num_threads(setup.threads)
        self.policy: Policy = load_policy(setup.model, seed=spec.seed)
        if self.policy.tokenizer is None:
            raise ValueError(f"spec.model {spec.model!r} has no tokenizer")
        self.tokenizer = self.policy.tokenizer
        if self.policy.vision is not None and self.mode == "rl":
            raise ValueError(
                f"spec.model {spec.model!r} is a vision-language model: it trains with SFT only "
                "for now (the rollout engines do not sample with images yet)"
            )
        self.vocab_size = self.policy.vocab_size
        self.samples = sample_config(spec)
        self.sft_samples: list[Sample] = []
        self.rl_samples: list[Sample] = []
        self.rl_advantages: list[float] = []
        self.rl_rewards: list[float] = []
        self.rl_sample_rewards: list[float] = []
        """The reward of each buffered sample's trajectory (a value model's returns)."""
        self.rl_sampled: list[bool] = []
        """Whether each buffered sample's trajectory carries its sampling logprobs."""
        self.critic_config = critic_config(spec)
        self.critic: TrainingEngine | None = None
        self.distillation = distillation_config(spec)
        self.teacher: PreTrainedModel | None = None
        if self.distillation is not None:
            if setup.teacher is None:
                raise ValueError("spec.distillation.teacher: no teacher model was handed over")
            self.teacher = load_teacher(
                setup.teacher, seed=spec.distillation.seed, student=self.policy
            )
        self._plan: MicroBatchPlan | None = None
        if setup.dataset is not None:
            with open(setup.dataset, encoding="utf-8") as lines:
                rows = parse_trajectories(lines, setup.dataset_name or setup.dataset)
                self.sft_samples.extend(self.policy.build_sft_samples(rows, self.samples).samples)
        self.validation_samples = 0
        self.validation_batches = self._validation_batches(setup)
        group = ProcessGroupSpec(
            rank=setup.rank,
            world_size=setup.world_size,
            master_addr=setup.master_addr,
            master_port=setup.master_port,
        )
        config = engine_config(spec)
        value_config = critic_engine_config(spec)
        # Copied before the policy's engine exists: under ZeRO-3 it partitions the weights.
        value_model = build_critic(self.policy.model) if self.critic_config else None
        self.reference = self._reference_model()
        checkpoint = universal = critic_universal = None
        if setup.resume_from is not None:
            checkpoint = read_checkpoint(setup.resume_from)
            if spec.zero_stage > 0 and saved_world_size(checkpoint) != setup.world_size:
                # The other ranks wait in the engine's first collective meanwhile.
                universal = Path(setup.scratch) / "universal"
                if value_model is not None:
                    critic_universal = Path(setup.scratch) / "universal-critic"
                if setup.rank == 0:
                    to_universal(checkpoint, universal)
                    if critic_universal is not None:
                        to_universal(checkpoint, critic_universal, part=CRITIC_DIR)
                config = replace(config, load_universal=True)
                value_config = replace(value_config, load_universal=True)
        self.engine = TrainingEngine(self.policy.model, config, process_group=group)
        for frozen in (self.reference, self.teacher):
            if frozen is not None:
                torch.nn.Module.to(frozen, self.engine.device)
        try:
            if value_model is not None:
                self.critic = TrainingEngine(value_model, value_config, process_group=group)
            if checkpoint is not None:
                load_checkpoint(self.engine, checkpoint, universal=universal)
                if self.critic is not None:
                    load_critic(self.critic, checkpoint, universal=critic_universal)
        except BaseException:
            self.close()
            raise
        finally:
            if universal is not None and setup.world_size > 1:
                torch.distributed.barrier()
            if setup.rank == 0:
                for folder in (universal, critic_universal):
                    if folder is not None:
                        shutil.rmtree(folder, ignore_errors=True)

    def _reference_model(self) -> PreTrainedModel | None:
        """The KL penalty's reference: a frozen copy of the job's starting policy (`spec.model`,
        also when resuming), kept only by RL jobs whose `policy_loss.kl_coef` is above 0."""
        if self.mode != "rl" or policy_loss_config(self.spec).kl_coef <= 0.0:
            return None
        reference = copy.deepcopy(self.policy.model)
        reference.train(False)  # no dropout: its logprobs are the reference
        reference.requires_grad_(False)
        return reference

    def _validation_batches(self, setup: RankSetup) -> list[TokenBatch]:
        """The validation set's samples in micro-batches of the job's size, in file order."""
        if setup.validation_dataset is None:
            return []
        name = self.spec.validation.dataset or "the held-out tasks"
        with open(setup.validation_dataset, encoding="utf-8") as lines:
            rows = parse_trajectories(lines, name)
            samples = self.policy.build_sft_samples(rows, self.samples).samples
        if not samples:
            raise ValueError(
                f"spec.validation: the validation set ({name}) gives no SFT sample: its rows "
                "have no loss token (failed rows without rise segments, or cut by "
                "max_sequence_tokens)"
            )
        size = self.spec.micro_batch_size
        self.validation_samples = len(samples)
        return [self.policy.collate(samples[i : i + size]) for i in range(0, len(samples), size)]

    def ready(self) -> RankReady:
        return RankReady(
            os.getpid(),
            self.engine.global_step,
            len(self.sft_samples),
            self.validation_samples,
        )

    # -- commands (every rank runs each one) -----------------------------------------------

    def submit(self, group: bytes, version_lag: dict[str, int | None] | None) -> SubmitCounts:
        """Add one group's samples to the buffer (see `jobs.JobRunner.submit`)."""
        message = trajectory_pb2.TrajectoryGroup.FromString(group)
        trajectories = list(message.trajectories)
        for trajectory in trajectories:
            self._check_tokens(trajectory)
        if self.mode == "sft":
            built = self.policy.build_sft_samples(trajectories, self.samples)
            self.sft_samples.extend(built.samples)
            self._plan = None
            reasons = Counter({str(k): v for k, v in built.skipped.items()})
            return SubmitCounts(1, len(built.samples), sum(reasons.values()), reasons)
        lag = None if version_lag is None else version_lag.get
        batch = build_rl_batch(trajectories, self._rl_config(), version_lag=lag)
        self.rl_samples.extend(batch.samples)
        self.rl_advantages.extend(batch.advantages)
        self.rl_sample_rewards.extend(batch.rewards)
        self.rl_sampled.extend(batch.sampled)
        if not math.isnan(batch.reward_mean):
            self.rl_rewards.append(batch.reward_mean)
        return SubmitCounts(
            1, len(batch.samples), len(trajectories) - len(batch.samples), Counter(batch.skipped)
        )

    def run_steps(self, steps: int) -> list[StepResult]:
        """SFT: `steps` optimizer steps of the seeded plan over the buffer. RL: `steps` updates
        of the clipped objective on the whole buffer, which they consume; with a value model,
        its pretraining first (on the job's first Step) and its steps after each update."""
        world = self.engine.world_size
        if self.mode == "sft":
            if not self.sft_samples:
                raise NotEnoughData(
                    "this SFT job has no samples: submit groups with trainable trajectories "
                    "(or give spec.dataset) before stepping"
                )
            if self._plan is None:
                self._plan = MicroBatchPlan(
                    self.sft_samples,
                    micro_batch_size=self.spec.micro_batch_size,
                    gradient_accumulation=self.spec.gradient_accumulation,
                    world_size=world,
                    pad_id=self.policy.pad_id,
                    seed=self.spec.seed,
                    collate_fn=self.policy.collate,
                )
            plan = self._plan
            results = []
            for _ in range(steps):
                result = self.engine.sft_step(
                    plan.for_step(self.engine.global_step, self.engine.rank)
                )
                results.append(self._validated(result, plan))
            return results
        needed = steps * self.spec.gradient_accumulation * world
        if len(self.rl_samples) < needed:
            raise NotEnoughData(
                f"{steps} RL step(s) with gradient_accumulation "
                f"{self.spec.gradient_accumulation} on {world} rank(s) need at least {needed} "
                f"trainable samples; {len(self.rl_samples)} are buffered: submit more groups"
            )
        rewards = self.rl_rewards
        batch = RlBatch(
            samples=tuple(self.rl_samples),
            advantages=tuple(self.rl_advantages),
            reward_mean=math.fsum(rewards) / len(rewards) if rewards else math.nan,
            rewards=tuple(self.rl_sample_rewards),
            sampled=tuple(self.rl_sampled),
        )
        self.rl_samples, self.rl_advantages, self.rl_rewards = [], [], []
        self.rl_sample_rewards, self.rl_sampled = [], []
        if self.teacher is not None and self.distillation is not None:
            return opd_update(
                self.engine,
                self.teacher,
                batch,
                self._rl_config(steps),
                self.distillation,
                pad_id=self.policy.pad_id,
                reference=self.reference,
            )
        if self.critic is None or self.critic_config is None:
            return run_rl_update(
                self.engine,
                batch,
                self._rl_config(steps),
                pad_id=self.policy.pad_id,
                reference=self.reference,
            )
        return self._ppo_steps(batch, steps, self.critic, self.critic_config)

    def _validated(self, result: StepResult, plan: MicroBatchPlan) -> StepResult:
        """`result` with the validation loss after it when an evaluation is due then."""
        validation = self.spec.validation
        if not self.validation_batches or not evaluation_due(
            result.step,
            total_steps=self.spec.total_steps,
            interval_steps=validation.interval_steps,
            steps_per_epoch=plan.steps_per_epoch,
        ):
            return result
        loss = self.engine.sft_validation(self.validation_batches)
        return replace(result, validation=replace(loss, epoch=plan.epoch_of(result.step - 1)))

    def save(self, version: str, metadata: dict[str, str]) -> CheckpointInfo:
        """Save the engine as ``<scratch>/saving/<version>`` (collective); rank 0's manifest."""
        root = Path(self.setup.scratch) / "saving"
        if self.engine.rank == 0:
            shutil.rmtree(root, ignore_errors=True)  # a save that died half-way
        if self.engine.world_size > 1:
            torch.distributed.barrier()
        return save_engine_checkpoint(
            self.engine,
            self.policy.saved_with,
            root,
            version=version,
            metadata=metadata,
            critic=self.critic,
        )

    def close(self) -> None:
        if self.critic is not None:
            self.critic.close()
        self.engine.close()

    # -- internals -------------------------------------------------------------------------

    def _check_tokens(self, trajectory: trajectory_pb2.Trajectory) -> None:
        for turn in trajectory.turns:
            for name in ("input_token_ids", "output_token_ids"):
                ids = getattr(turn, name)
                if any(t < 0 or t >= self.vocab_size for t in ids):
                    raise ValueError(
                        f"trajectory {trajectory.id!r} turn {turn.index}: {name} holds ids "
                        f"outside the model's vocabulary [0, {self.vocab_size})"
                    )

    def _ppo_steps(
        self, batch: RlBatch, steps: int, critic: TrainingEngine, config: CriticConfig
    ) -> list[StepResult]:
        pretrain: list[StepResult] = []
        pretrain_steps = self.spec.critic.value_pretrain_steps
        if critic.global_step == 0 and pretrain_steps > 0:
            pretrain = value_pretrain(
                critic,
                batch,
                steps=pretrain_steps,
                updates=steps,
                critic_config=config,
                pad_id=self.policy.pad_id,
            )
            if self.engine.rank == 0:
                log.info(
                    "value pretraining of job %s: %d step(s), loss %.4g -> %.4g",
                    self.setup.job_id,
                    len(pretrain),
                    pretrain[0].loss,
                    pretrain[-1].loss,
                )
        ppo = ppo_update(
            self.engine,
            critic,
            batch,
            self._rl_config(steps),
            config,
            pad_id=self.policy.pad_id,
            reference=self.reference,
        )
        results = ppo.steps()
        if pretrain:
            first = results[0]
            results[0] = replace(
                first,
                extra={
                    **first.extra,
                    "value_pretrain_steps": float(len(pretrain)),
                    "value_pretrain_loss_first": pretrain[0].loss,
                    "value_pretrain_loss_last": pretrain[-1].loss,
                },
            )
        return results

    def _rl_config(self, updates: int = 1) -> RlConfig:
        bounded = self.spec.HasField("max_staleness")
        return RlConfig(
            loss=policy_loss_config(self.spec),
            samples=self.samples,
            updates_per_batch=updates,
            # A critic's or a teacher's advantages are per token: a group whose rewards agree
            # still teaches; a teacher needs no reward at all.
            skip_zero_advantage=self.critic_config is None and self.distillation is None,
            require_reward=self.distillation is None,
            max_staleness=self.spec.max_staleness if bounded else None,
            stale=StalePolicy.SKIP if self.spec.skip_stale else StalePolicy.REJECT,
        )


COMMANDS = frozenset({"submit", "run_steps", "save"})


def _exit_with_parent(parent: int) -> None:
    """End this process when the controller is gone (its connection may be held up by a
    collective this rank is blocked in)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def serve(conn: Connection) -> int:
    """Run the rank: setup, then commands until told to stop or the controller is gone."""
    threading.Thread(
        target=_exit_with_parent, args=(os.getppid(),), name="parent-watch", daemon=True
    ).start()
    try:
        setup = conn.recv()
    except EOFError:
        return 0  # a worker Pod's rank whose controller went away before sending the setup
    if not isinstance(setup, RankSetup):
        return 0  # its group was closed before it was set up (a worker Pod's rank)
    try:
        trainer = RankTrainer(setup)
    except Exception as exc:
        log.exception("rank %d of job %s could not start", setup.rank, setup.job_id)
        conn.send(("error", RankFault.of(exc)))
        return 1
    conn.send(("ok", trainer.ready()))
    try:
        while True:
            try:
                name, arguments = conn.recv()
            except EOFError:
                return 0
            if name == "close":
                return 0
            if name not in COMMANDS:
                conn.send(("error", RankFault("other", f"unknown command {name!r}")))
                continue
            try:
                value: Any = getattr(trainer, name)(**arguments)
            except Exception as exc:
                conn.send(("error", RankFault.of(exc)))
            else:
                conn.send(("ok", value))
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchard.trainer.rank",
        description="One rank of a training job; started by the trainer service.",
    )
    parser.add_argument("--conn-fd", type=int, required=True, help="the controller's socket")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(process)d %(message)s")
    os.set_inheritable(args.conn_fd, False)
    with Connection(args.conn_fd) as conn:
        return serve(conn)


if __name__ == "__main__":
    # Run the module under its own name, so what it pickles names `orchard.trainer.rank`.
    from orchard.trainer.rank import main as rank_main

    sys.exit(rank_main())
