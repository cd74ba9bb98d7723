"""One training job inside the service: its spec resolved, its engine, its data buffer.

`resolve_spec` fills a `TrainingJobSpec`'s unset (zero) fields with their defaults and refuses
what cannot run (`SpecError`, a message that names the field). `JobRunner` holds what a running
job needs in memory: the policy and its DeepSpeed engine (a world of one, in the service's
process), the samples submitted and not yet trained on, and the job's run log. Its methods are
synchronous and slow (they train); the service calls them off the event loop, one at a time per
job.

Data:

- SFT: the samples of `spec.dataset` (read at start) and of every submitted group form one
  sample set; step `k` trains on micro-batches `k` of a seeded plan over it (epochs follow one
  another, as in offline SFT), so a job without any sample cannot step;
- RL: each submitted group becomes samples with group-relative advantages
  (`rl.build_rl_batch`), after the staleness bound of `spec.max_staleness` when it is set; a
  `Step` of `n` optimizer steps consumes the whole buffer (`rl.rl_update`, `n` updates on it)
  and needs at least `n x gradient_accumulation` trainable samples.
"""

from __future__ import annotations

import math
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from orchard.core.artifacts import ArtifactNotFound, ArtifactStore, parse_url
from orchard.lm.weights import InvalidWeightVersion, check_model_name
from orchard.trainer.checkpoints import (
    MANIFEST,
    StoredCheckpoint,
    load_checkpoint,
    save_checkpoint,
)
from orchard.trainer.datasets import parse_trajectories
from orchard.trainer.distributed import ProcessGroupSpec
from orchard.trainer.engine import EngineConfig, StepResult, TrainingEngine
from orchard.trainer.losses import PolicyLossConfig
from orchard.trainer.masks import Overflow, Sample, SampleConfig, build_sft_samples
from orchard.trainer.microbatches import MicroBatchPlan
from orchard.trainer.policy import BUILTIN_SIZES, Policy, load_policy
from orchard.trainer.rl import (
    RlBatch,
    RlConfig,
    StalePolicy,
    VersionLag,
    build_rl_batch,
    rl_update,
)
from orchard.trainer.telemetry import StepRecord, StepRecorder
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.types.v1 import trajectory_pb2

__all__ = [
    "DEFAULTS",
    "JobRunner",
    "NotEnoughData",
    "SpecError",
    "SubmitCounts",
    "check_artifacts",
    "checkpoint_version",
    "engine_config",
    "resolve_spec",
]

MODE_NAMES = {api.TRAINING_MODE_SFT: "sft", api.TRAINING_MODE_RL: "rl"}


@dataclass(frozen=True)
class _Defaults:
    learning_rate: float = 1e-4
    total_steps: int = 1000
    micro_batch_size: int = 8
    gradient_accumulation: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.28
    importance_cap: float = 2.0


DEFAULTS = _Defaults()
"""What a zero (unset) field of a `TrainingJobSpec` becomes."""


class SpecError(ValueError):
    """A job spec that cannot run; the message names the field and what to give instead."""


class NotEnoughData(Exception):
    """A step was asked for before enough data was submitted."""


def resolve_spec(spec: api.TrainingJobSpec) -> api.TrainingJobSpec:
    """`spec` with unset fields at their defaults, checked; raises `SpecError`."""
    out = api.TrainingJobSpec()
    out.CopyFrom(spec)
    if out.mode not in MODE_NAMES:
        raise SpecError("spec.mode must be TRAINING_MODE_SFT or TRAINING_MODE_RL")
    if not out.model:
        raise SpecError(
            'spec.model is required: "builtin:<size>" '
            f"({', '.join(BUILTIN_SIZES)}) or the artifact URL of a Hugging Face model folder"
        )
    if out.model.startswith("builtin:"):
        if out.model.removeprefix("builtin:") not in BUILTIN_SIZES:
            raise SpecError(
                f"spec.model {out.model!r}: unknown built-in size; known: "
                f"{', '.join('builtin:' + s for s in BUILTIN_SIZES)}"
            )
    else:
        out.model = parse_url(out.model, what="spec.model").url
    if not 0 <= out.zero_stage <= 3:
        raise SpecError(f"spec.zero_stage must be 0, 1, 2 or 3, got {out.zero_stage}")
    for name in ("warmup_steps", "total_steps", "micro_batch_size", "gradient_accumulation"):
        if getattr(out, name) < 0:
            raise SpecError(f"spec.{name} must not be negative, got {getattr(out, name)}")
    if out.max_sequence_tokens < 0 or out.max_sequence_tokens == 1:
        raise SpecError(
            f"spec.max_sequence_tokens must be 0 (no limit) or at least 2, got "
            f"{out.max_sequence_tokens}"
        )
    if not (math.isfinite(out.learning_rate) and out.learning_rate >= 0):
        raise SpecError(f"spec.learning_rate must be a positive number, got {out.learning_rate}")
    out.learning_rate = out.learning_rate or DEFAULTS.learning_rate
    out.total_steps = out.total_steps or DEFAULTS.total_steps
    out.micro_batch_size = out.micro_batch_size or DEFAULTS.micro_batch_size
    out.gradient_accumulation = out.gradient_accumulation or DEFAULTS.gradient_accumulation
    if out.warmup_steps > out.total_steps:
        raise SpecError(
            f"spec.warmup_steps ({out.warmup_steps}) must not exceed spec.total_steps "
            f"({out.total_steps})"
        )
    loss = out.policy_loss
    loss.clip_low = loss.clip_low or DEFAULTS.clip_low
    loss.clip_high = loss.clip_high or DEFAULTS.clip_high
    loss.importance_cap = loss.importance_cap or DEFAULTS.importance_cap
    try:
        policy_loss_config(out)
    except ValueError as exc:
        raise SpecError(f"spec.policy_loss: {exc}") from None
    if out.HasField("max_staleness") or out.skip_stale:
        if out.mode != api.TRAINING_MODE_RL:
            raise SpecError("spec.max_staleness and spec.skip_stale are for RL jobs")
        if not out.HasField("max_staleness"):
            raise SpecError("spec.skip_stale needs spec.max_staleness, the bound to apply")
        if out.max_staleness < 0:
            raise SpecError(
                f"spec.max_staleness must be 0 or more versions, got {out.max_staleness}"
            )
    if out.weight_model:
        try:
            check_model_name(out.weight_model)
        except InvalidWeightVersion as exc:
            raise SpecError(f"spec.weight_model: {exc}") from None
    if out.dataset:
        if out.mode != api.TRAINING_MODE_SFT:
            raise SpecError("spec.dataset is for SFT jobs; RL jobs train on submitted groups")
        out.dataset = parse_url(out.dataset, what="spec.dataset").url
    return out


def check_artifacts(spec: api.TrainingJobSpec, store: ArtifactStore, cache: Path) -> None:
    """Refuse a resolved spec whose model or dataset URL the store does not allow or hold
    (PERMISSION_DENIED, NOT_FOUND); reads the store (a model folder from a non-file store is
    fetched into `cache` for the job), so it runs off the event loop."""
    if not spec.model.startswith("builtin:"):
        store.require(spec.model, what="spec.model", folder=True)
        if not store.is_file(f"{spec.model}/config.json"):
            raise ArtifactNotFound(
                spec.model,
                f"spec.model {spec.model!r} is not a model folder: it has no config.json (a "
                "Hugging Face causal LM saved with save_pretrained)",
            )
        if not any(store.is_file(f"{spec.model}/{n}") for n in _TOKENIZER_FILES):
            raise SpecError(
                f"spec.model {spec.model!r} has no tokenizer; checkpoints are saved with the "
                "model's tokenizer, so save it into the folder too"
            )
        store.get_dir(spec.model, cache_dir=cache)  # a link in the folder out of the store
    if spec.dataset:
        store.require(spec.dataset, what="spec.dataset")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def artifact_cache(scratch_dir: Path) -> Path:
    """Where model folders and checkpoints from non-file stores are downloaded, once each."""
    return scratch_dir / ".artifact-cache"


def engine_config(spec: api.TrainingJobSpec) -> EngineConfig:
    """The engine settings of a resolved spec."""
    return EngineConfig(
        zero_stage=spec.zero_stage,
        micro_batch_size=spec.micro_batch_size,
        gradient_accumulation=spec.gradient_accumulation,
        learning_rate=spec.learning_rate,
        warmup_steps=spec.warmup_steps,
        total_steps=spec.total_steps,
    )


def sample_config(spec: api.TrainingJobSpec) -> SampleConfig:
    return SampleConfig(
        context_window=spec.max_sequence_tokens or None,
        overflow=Overflow.DROP if spec.drop_long else Overflow.TRUNCATE_LEFT,
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


def checkpoint_version(job_id: str, step: int) -> str:
    """The version name of a job's checkpoint at `step`: ``<job id>-step-000120``."""
    return f"{job_id}-step-{step:06d}"


@dataclass(frozen=True, slots=True)
class SubmitCounts:
    groups: int = 0
    trainable: int = 0
    skipped: int = 0
    skip_reasons: Counter[str] = field(default_factory=Counter)


class JobRunner:
    """The in-memory half of a running job (see the module docstring)."""

    def __init__(
        self,
        job_id: str,
        spec: api.TrainingJobSpec,
        store: ArtifactStore,
        checkpoint_url: str,
        scratch: Path,
        *,
        resume_from: str | None = None,
        recorder: StepRecorder | None = None,
    ) -> None:
        """Load the model and build the engine (slow); with `resume_from`, a checkpoint's URL,
        restore its weights, optimizer, schedule and step.

        `checkpoint_url` is this job's folder in the store (``<checkpoint_url>/<job id>``);
        `scratch` a local folder of this process: checkpoints are written there before they
        are put in the store, downloads are cached there, and the run log is kept there.
        """
        self.job_id = job_id
        self.spec = spec
        self.mode = MODE_NAMES[spec.mode]
        self.store = store
        self.checkpoint_url = checkpoint_url
        self.scratch = scratch
        self._metrics = recorder
        model = spec.model
        if not model.startswith("builtin:"):
            model = str(store.get_dir(model, cache_dir=self._cache))
        self.policy: Policy = load_policy(model)
        tokenizer = self.policy.tokenizer
        if tokenizer is None:
            raise SpecError(f"spec.model {spec.model!r} has no tokenizer")
        self.tokenizer = tokenizer
        self.vocab_size = int(self.policy.model.config.vocab_size)
        self.samples = sample_config(spec)
        self.sft_samples: list[Sample] = []
        self.rl_samples: list[Sample] = []
        self.rl_advantages: list[float] = []
        self.rl_rewards: list[float] = []
        self._plan: MicroBatchPlan | None = None
        self.cancelled = False
        if spec.dataset:
            with store.open_read(spec.dataset, text=True) as lines:
                rows = parse_trajectories(lines, spec.dataset)
                dataset = build_sft_samples(rows, self.samples)
            self.sft_samples.extend(dataset.samples)
        # One rank in this process, on a port of its own, whatever the environment says.
        self.engine = TrainingEngine(
            self.policy.model, engine_config(spec), process_group=ProcessGroupSpec()
        )
        try:
            if resume_from is not None:
                load_checkpoint(self.engine, store.get_dir(resume_from, cache_dir=self._cache))
            self._restore_run_log()
            self.run_log = StepRecorder(scratch / "run.jsonl")
        except BaseException:
            self.engine.close()
            raise

    @property
    def _cache(self) -> Path:
        return artifact_cache(self.scratch.parent)

    @property
    def step(self) -> int:
        return self.engine.global_step

    @property
    def steps_left(self) -> int:
        return self.spec.total_steps - self.step

    @property
    def buffered(self) -> int:
        return len(self.rl_samples) if self.mode == "rl" else len(self.sft_samples)

    def _check_tokens(self, trajectory: trajectory_pb2.Trajectory) -> None:
        for turn in trajectory.turns:
            for name in ("input_token_ids", "output_token_ids"):
                ids = getattr(turn, name)
                if any(t < 0 or t >= self.vocab_size for t in ids):
                    raise ValueError(
                        f"trajectory {trajectory.id!r} turn {turn.index}: {name} holds ids "
                        f"outside the model's vocabulary [0, {self.vocab_size})"
                    )

    def submit(
        self, group: trajectory_pb2.TrajectoryGroup, version_lag: VersionLag | None = None
    ) -> SubmitCounts:
        """Add one group's samples to the buffer; raises `ValueError` (or `TrajectoryError`)
        for a malformed trajectory and `StaleBatchError` for one sampled by weights older than
        `spec.max_staleness` allows (with `version_lag`), adding nothing of the group."""
        trajectories = list(group.trajectories)
        for trajectory in trajectories:
            self._check_tokens(trajectory)
        if self.mode == "sft":
            built = build_sft_samples(trajectories, self.samples)
            self.sft_samples.extend(built.samples)
            self._plan = None
            reasons = Counter({str(k): v for k, v in built.skipped.items()})
            return SubmitCounts(1, len(built.samples), sum(reasons.values()), reasons)
        batch = build_rl_batch(trajectories, self._rl_config(), version_lag=version_lag)
        self.rl_samples.extend(batch.samples)
        self.rl_advantages.extend(batch.advantages)
        if not math.isnan(batch.reward_mean):
            self.rl_rewards.append(batch.reward_mean)
        return SubmitCounts(
            1, len(batch.samples), len(trajectories) - len(batch.samples), batch.skipped
        )

    def _rl_config(self, updates: int = 1) -> RlConfig:
        bounded = self.spec.HasField("max_staleness")
        return RlConfig(
            loss=policy_loss_config(self.spec),
            samples=self.samples,
            updates_per_batch=updates,
            max_staleness=self.spec.max_staleness if bounded else None,
            stale=StalePolicy.SKIP if self.spec.skip_stale else StalePolicy.REJECT,
        )

    def run_steps(
        self, steps: int, on_step: Callable[[StepResult], None] | None = None
    ) -> list[StepResult]:
        """Train `steps` optimizer steps on the buffer; stops early when cancelled."""
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
                    world_size=1,
                    pad_id=self.policy.pad_id,
                )
            results = []
            for _ in range(steps):
                if self.cancelled:
                    break
                result = self.engine.sft_step(self._plan.for_step(self.step, 0))
                self._record(result)
                if on_step is not None:
                    on_step(result)
                results.append(result)
            return results
        needed = steps * self.spec.gradient_accumulation
        if len(self.rl_samples) < needed:
            raise NotEnoughData(
                f"{steps} RL step(s) with gradient_accumulation "
                f"{self.spec.gradient_accumulation} need at least {needed} trainable samples; "
                f"{len(self.rl_samples)} are buffered: submit more groups"
            )
        rewards = self.rl_rewards
        batch = RlBatch(
            samples=tuple(self.rl_samples),
            advantages=tuple(self.rl_advantages),
            reward_mean=math.fsum(rewards) / len(rewards) if rewards else math.nan,
        )
        self.rl_samples, self.rl_advantages, self.rl_rewards = [], [], []
        results = rl_update(self.engine, batch, self._rl_config(steps), pad_id=self.policy.pad_id)
        for result in results:
            self._record(result)
            if on_step is not None:
                on_step(result)
        return results

    def _record(self, result: StepResult) -> None:
        record = StepRecord.of(self.job_id, self.mode, result)
        self.run_log.record(record)
        if self._metrics is not None:
            self._metrics.record(record)

    def save(self, metadata: dict[str, str] | None = None) -> StoredCheckpoint:
        """Save a checkpoint at the current step into the store (the stored one when already
        saved): written in the scratch folder, put in the store whole, then removed here."""
        version = checkpoint_version(self.job_id, self.step)
        url = f"{self.checkpoint_url}/{version}"
        if self.store.exists(f"{url}/{MANIFEST}"):
            return StoredCheckpoint.from_manifest(self.store.read_bytes(f"{url}/{MANIFEST}"), url)
        local_root = self.scratch / "saving"
        shutil.rmtree(local_root, ignore_errors=True)  # a save that died half-way
        try:
            info = save_checkpoint(
                self.engine,
                self.tokenizer,
                local_root,
                version=version,
                metadata={"job": self.job_id, "mode": self.mode, **(metadata or {})},
            )
            stored = self.store.put_dir(info.path, url)
        finally:
            shutil.rmtree(local_root, ignore_errors=True)
        # the run log, a report, goes with each checkpoint (replaced whole, so never torn)
        self.store.write_bytes(self.run_log_url, (self.scratch / "run.jsonl").read_bytes())
        return StoredCheckpoint.of(info, stored)

    @property
    def run_log_url(self) -> str:
        """Where the job's run log is kept in the store (refreshed at each checkpoint)."""
        return f"{self.checkpoint_url}/run.jsonl"

    def _restore_run_log(self) -> None:
        """A process with an empty scratch folder continues the log kept in the store."""
        local = self.scratch / "run.jsonl"
        if not local.exists() and self.store.exists(self.run_log_url):
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(self.store.read_bytes(self.run_log_url))

    def close(self) -> None:
        self.engine.close()
        self.run_log.close()
