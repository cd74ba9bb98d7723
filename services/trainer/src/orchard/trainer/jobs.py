"""One training job inside the service: its spec resolved, and its worker group.

`resolve_spec` fills a `TrainingJobSpec`'s unset (zero) fields with their defaults and refuses
what cannot run (`SpecError`, a message that names the field). `JobRunner` is the service's
handle on a running job: the worker group of `spec.ranks` processes (`workers.WorkerGroup`)
that hold the policy, its DeepSpeed engine and the samples submitted and not yet trained on
(`rank.RankTrainer`), and the job's run log. The service process itself never trains: it
fetches what the ranks read from the artifact store, sends them commands and uploads what they
save. Its methods are synchronous and slow (they wait for the ranks); the service calls them
off the event loop, one at a time per job.

Data (every rank holds the whole buffer and trains on its share of each step):

- SFT: the samples of `spec.dataset` (read at start) and of every submitted group form one
  sample set; step `k` trains on micro-batches `k` of a seeded plan over it (epochs follow one
  another, as in offline SFT; `microbatches.MicroBatchPlan` gives each rank its own, shuffled
  with `spec.seed`), so a job without any sample cannot step. With `spec.validation` the ranks
  also hold a validation set (its own dataset, or the tasks `plan_validation` held out of the
  dataset, which this process splits off before the ranks read it) and evaluate its loss after
  the steps it names; the runner's `validation.ValidationTracker` keeps the best one's
  checkpoint and ends the job early when told;
- RL: each submitted group becomes samples with group-relative advantages
  (`rl.build_rl_batch`), after the staleness bound of `spec.max_staleness` when it is set; a
  `Step` of `n` optimizer steps consumes the whole buffer (`rl.rl_update`, `n` updates on it)
  and needs at least `n x gradient_accumulation x ranks` trainable samples. With
  `spec.advantage_estimator` ADVANTAGE_ESTIMATOR_CRITIC the ranks also hold a value model:
  samples keep their rewards (zero group advantages included), the job's first Step runs
  `spec.critic.value_pretrain_steps` value-model steps on its batch, and every Step is
  `critic.ppo_update` (per-token advantages from the value model, then its own steps). With
  ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION the ranks hold `spec.distillation.teacher`
  (fetched here like the model, its tokenizer checked against the student's before the job is
  created), unscored trajectories and groups whose rewards agree are trainable, and every Step
  is `distillation.opd_update` (per-token teacher-minus-student log-ratios).
"""

from __future__ import annotations

import io
import logging
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchard.core.artifacts import ArtifactNotFound, ArtifactStore, parse_url
from orchard.core.success import check_success_threshold
from orchard.lm.tokenizer import build_tokenizer
from orchard.lm.weights import InvalidWeightVersion, check_model_name
from orchard.trainer.checkpoints import (
    MANIFEST,
    CheckpointError,
    CheckpointInfo,
    StoredCheckpoint,
)
from orchard.trainer.critic import CriticConfig
from orchard.trainer.datasets import DatasetError, parse_trajectories, write_trajectories
from orchard.trainer.distillation import DistillationConfig, TeacherMismatch, check_same_vocabulary
from orchard.trainer.engine import StepResult
from orchard.trainer.masks import TrajectoryError, build_sft_samples
from orchard.trainer.policy import BUILTIN_SIZES
from orchard.trainer.rank import (
    NotEnoughData,
    RankSetup,
    SubmitCounts,
    critic_config,
    engine_config,
    policy_loss_config,
    sample_config,
)
from orchard.trainer.rl import StaleBatchError
from orchard.trainer.telemetry import StepRecord, StepRecorder
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.trainer.validation import (
    ValidationSetError,
    ValidationTracker,
    hold_out_tasks,
    split_by_task,
)
from orchard.trainer.workers import RankError, RankTransport, WorkerGroup, WorkerGroupConfig
from orchard.types.v1 import trajectory_pb2

if TYPE_CHECKING:
    from orchard.trainer.ray_workers import RayPlacement, RayRuntime, RayWorkerGroup

__all__ = [
    "DEFAULTS",
    "JobRunner",
    "JobStartError",
    "NotEnoughData",
    "RankFailed",
    "SpecError",
    "SubmitCounts",
    "check_artifacts",
    "checkpoint_version",
    "engine_config",
    "plan_validation",
    "resolve_spec",
]

MODE_NAMES = {api.TRAINING_MODE_SFT: "sft", api.TRAINING_MODE_RL: "rl"}

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RayWorkers:
    """Where a job's ranks go when they are Ray actors."""

    placement: RayPlacement
    runtime: RayRuntime


VersionLag = dict[str, int | None]
"""How many versions each weight version a group names lags behind the latest one."""


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


class JobStartError(Exception):
    """The job's ranks could not start (the model does not load, the engine does not build)."""


class RankFailed(Exception):
    """A command failed in a rank for a reason that is not the caller's input."""


def resolve_spec(spec: api.TrainingJobSpec, *, max_ranks: int = 0) -> api.TrainingJobSpec:
    """`spec` with unset fields at their defaults, checked; raises `SpecError`. `max_ranks`
    bounds `spec.ranks` (0: no bound); 0 ranks stays 0, the service's default."""
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
    if out.ranks < 0 or (max_ranks and out.ranks > max_ranks):
        raise SpecError(
            f"spec.ranks must be 0 (the service's workers.ranks) to {max_ranks or 'any'}, "
            f"got {out.ranks}"
        )
    for name in ("warmup_steps", "total_steps", "micro_batch_size", "gradient_accumulation"):
        if getattr(out, name) < 0:
            raise SpecError(f"spec.{name} must not be negative, got {getattr(out, name)}")
    if out.max_sequence_tokens < 0 or out.max_sequence_tokens == 1:
        raise SpecError(
            f"spec.max_sequence_tokens must be 0 (no limit) or at least 2, got "
            f"{out.max_sequence_tokens}"
        )
    if out.HasField("success_threshold"):
        try:
            check_success_threshold(out.success_threshold, "spec.success_threshold")
        except ValueError as exc:
            raise SpecError(str(exc)) from None
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
    _resolve_advantages(out)
    if out.weight_model:
        try:
            check_model_name(out.weight_model)
        except InvalidWeightVersion as exc:
            raise SpecError(f"spec.weight_model: {exc}") from None
    if out.dataset:
        if out.mode != api.TRAINING_MODE_SFT:
            raise SpecError("spec.dataset is for SFT jobs; RL jobs train on submitted groups")
        out.dataset = parse_url(out.dataset, what="spec.dataset").url
    _resolve_validation(out)
    return out


def _resolve_validation(out: api.TrainingJobSpec) -> None:
    """Check `spec.validation` (SFT only; a dataset or a fraction, not both)."""
    if not out.HasField("validation"):
        return
    v = out.validation
    if out.mode != api.TRAINING_MODE_SFT:
        raise SpecError(
            "spec.validation is for SFT jobs; leave it unset for RL (RL picks versions by "
            "their rollouts)"
        )
    if not (math.isfinite(v.fraction) and 0.0 <= v.fraction < 1.0):
        raise SpecError(
            f"spec.validation.fraction must be in [0, 1): the share of the dataset's tasks held "
            f"out (0: none), got {v.fraction}"
        )
    if v.fraction > 0 and v.dataset:
        raise SpecError(
            "spec.validation takes a dataset or a fraction of spec.dataset's tasks, not both"
        )
    if v.fraction > 0 and not out.dataset:
        raise SpecError(
            "spec.validation.fraction holds tasks out of spec.dataset, and the job has none: "
            "give spec.dataset, or a validation set in spec.validation.dataset"
        )
    if v.dataset:
        v.dataset = parse_url(v.dataset, what="spec.validation.dataset").url
    if v.interval_steps < 0:
        raise SpecError(
            f"spec.validation.interval_steps must be 0 (once per epoch) or more, got "
            f"{v.interval_steps}"
        )
    if v.patience < 0:
        raise SpecError(
            f"spec.validation.patience must be 0 (no early stopping) or more, got {v.patience}"
        )
    if not (math.isfinite(v.min_delta) and v.min_delta >= 0):
        raise SpecError(f"spec.validation.min_delta must be 0 or more, got {v.min_delta}")
    if not v.dataset and v.fraction == 0:
        if v.interval_steps or v.patience or v.min_delta:
            raise SpecError(
                "spec.validation has settings but no validation set: give "
                "spec.validation.fraction (tasks held out of spec.dataset) or "
                "spec.validation.dataset"
            )
        out.ClearField("validation")


def plan_validation(spec: api.TrainingJobSpec, store: ArtifactStore) -> api.ValidationProgress:
    """A resolved SFT spec's validation set before the job starts: the tasks
    `validation.fraction` holds out of the dataset (read from the store), or a check that
    `validation.dataset` gives samples. Raises `SpecError` for a set that cannot be (too few
    tasks, no sample); reads the store, so it runs off the event loop."""
    progress = api.ValidationProgress()
    if not spec.HasField("validation"):
        return progress
    samples = sample_config(spec)
    url = spec.validation.dataset or spec.dataset
    try:
        with store.open_read(url) as raw:
            rows = list(parse_trajectories(io.TextIOWrapper(raw, encoding="utf-8"), url))
        if spec.validation.fraction > 0:
            progress.held_out_tasks.extend(
                hold_out_tasks(rows, spec.validation.fraction, spec.seed, samples)
            )
        elif not build_sft_samples(rows, samples).samples:
            raise SpecError(
                f"spec.validation.dataset {url!r} gives no SFT sample: its rows have no loss "
                "token (failed rows without rise segments, or cut by max_sequence_tokens)"
            )
    except (ValidationSetError, DatasetError, TrajectoryError) as exc:
        raise SpecError(str(exc)) from None
    return progress


_ESTIMATORS = (
    api.ADVANTAGE_ESTIMATOR_GROUP_RELATIVE,
    api.ADVANTAGE_ESTIMATOR_CRITIC,
    api.ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION,
)


def _resolve_advantages(out: api.TrainingJobSpec) -> None:
    """Check `spec.advantage_estimator`, `spec.critic` and `spec.distillation` and fill in
    their defaults."""
    estimator = out.advantage_estimator
    if out.mode != api.TRAINING_MODE_RL:
        if (
            estimator != api.ADVANTAGE_ESTIMATOR_UNSPECIFIED
            or out.HasField("critic")
            or out.HasField("distillation")
        ):
            raise SpecError(
                "spec.advantage_estimator, spec.critic and spec.distillation are for RL jobs "
                "(TRAINING_MODE_RL); leave them unset for SFT (SFT on a teacher's rollouts: "
                "PrepareDataset, then spec.dataset)"
            )
        return
    if estimator == api.ADVANTAGE_ESTIMATOR_UNSPECIFIED:
        out.advantage_estimator = api.ADVANTAGE_ESTIMATOR_GROUP_RELATIVE
    elif estimator not in _ESTIMATORS:
        raise SpecError(
            f"spec.advantage_estimator must be ADVANTAGE_ESTIMATOR_GROUP_RELATIVE (1, the "
            f"default), ADVANTAGE_ESTIMATOR_CRITIC (2) or "
            f"ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION (3), got {estimator}"
        )
    _resolve_distillation(out)
    if out.advantage_estimator != api.ADVANTAGE_ESTIMATOR_CRITIC:
        if out.HasField("critic"):
            raise SpecError(
                "spec.critic configures the value model of ADVANTAGE_ESTIMATOR_CRITIC: set "
                "spec.advantage_estimator to it, or leave spec.critic unset for group-relative "
                "advantages"
            )
        return
    c = out.critic
    if not (math.isfinite(c.learning_rate) and c.learning_rate >= 0):
        raise SpecError(
            "spec.critic.learning_rate must be 0 (the job's learning_rate) or a positive "
            f"number, got {c.learning_rate}"
        )
    if c.steps_per_update < 0:
        raise SpecError(
            f"spec.critic.steps_per_update must be 0 (one step) or more, got {c.steps_per_update}"
        )
    for name in ("gamma", "gae_lambda"):
        value = getattr(c, name)
        if c.HasField(name) and not 0.0 <= value <= 1.0:
            raise SpecError(f"spec.critic.{name} must be in [0, 1] (unset: 1), got {value}")
    if c.HasField("value_clip") and not (math.isfinite(c.value_clip) and c.value_clip >= 0):
        raise SpecError(
            "spec.critic.value_clip must be 0 (no clipping) or a positive number (unset: 0.2), "
            f"got {c.value_clip}"
        )
    if c.value_pretrain_steps < 0:
        raise SpecError(
            "spec.critic.value_pretrain_steps must be 0 (no value pretraining) or more, got "
            f"{c.value_pretrain_steps}"
        )
    default = CriticConfig()
    c.learning_rate = c.learning_rate or out.learning_rate
    c.steps_per_update = c.steps_per_update or default.steps_per_update
    if not c.HasField("gamma"):
        c.gamma = default.gamma
    if not c.HasField("gae_lambda"):
        c.gae_lambda = default.lam
    if not c.HasField("value_clip"):
        c.value_clip = default.value_clip or 0.0
    try:
        critic_config(out)
    except ValueError as exc:
        raise SpecError(f"spec.critic: {exc}") from None


def _resolve_distillation(out: api.TrainingJobSpec) -> None:
    """Check `spec.distillation` against the estimator and fill in its coefficient."""
    if out.advantage_estimator != api.ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION:
        if out.HasField("distillation"):
            raise SpecError(
                "spec.distillation names the teacher of "
                "ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION: set spec.advantage_estimator to "
                "it, or leave spec.distillation unset"
            )
        return
    d = out.distillation
    if not d.teacher:
        raise SpecError(
            "spec.distillation.teacher is required with "
            'ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION: "builtin:<size>" '
            f"({', '.join(BUILTIN_SIZES)}) or the artifact URL of a Hugging Face model folder "
            "with the student's tokenizer (e.g. a published weight version's location)"
        )
    if d.teacher.startswith("builtin:"):
        if d.teacher.removeprefix("builtin:") not in BUILTIN_SIZES:
            raise SpecError(
                f"spec.distillation.teacher {d.teacher!r}: unknown built-in size; known: "
                f"{', '.join('builtin:' + s for s in BUILTIN_SIZES)}"
            )
    else:
        d.teacher = parse_url(d.teacher, what="spec.distillation.teacher").url
    if not d.HasField("coef"):
        d.coef = DistillationConfig().coef
    if not (math.isfinite(d.coef) and d.coef > 0):
        raise SpecError(
            f"spec.distillation.coef must be a finite number above 0 (unset: 1), got {d.coef}"
        )


def check_artifacts(spec: api.TrainingJobSpec, store: ArtifactStore, cache: Path) -> None:
    """Refuse a resolved spec whose model, teacher or dataset URL the store does not allow or
    hold (PERMISSION_DENIED, NOT_FOUND), or whose teacher's vocabulary is not the student's
    (`SpecError`); reads the store (a model folder from a non-file store is fetched into
    `cache` for the job), so it runs off the event loop."""
    if not spec.model.startswith("builtin:"):
        _check_model_folder(spec.model, "spec.model", store, cache)
    if spec.distillation.teacher:
        teacher = spec.distillation.teacher
        if not teacher.startswith("builtin:"):
            _check_model_folder(teacher, "spec.distillation.teacher", store, cache)
        try:
            check_same_vocabulary(
                _tokenizer(spec.model, store, cache),
                _tokenizer(teacher, store, cache),
                teacher_name=teacher,
            )
        except TeacherMismatch as exc:
            raise SpecError(str(exc)) from None
    if spec.dataset:
        store.require(spec.dataset, what="spec.dataset")
    if spec.validation.dataset:
        store.require(spec.validation.dataset, what="spec.validation.dataset")


def _check_model_folder(url: str, what: str, store: ArtifactStore, cache: Path) -> None:
    store.require(url, what=what, folder=True)
    if not store.is_file(f"{url}/config.json"):
        raise ArtifactNotFound(
            url,
            f"{what} {url!r} is not a model folder: it has no config.json (a Hugging Face "
            "causal LM saved with save_pretrained)",
        )
    if not any(store.is_file(f"{url}/{n}") for n in _TOKENIZER_FILES):
        raise SpecError(
            f"{what} {url!r} has no tokenizer; checkpoints are saved with the model's "
            "tokenizer, so save it into the folder too"
        )
    store.get_dir(url, cache_dir=cache)  # a link in the folder out of the store


def _tokenizer(model: str, store: ArtifactStore, cache: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a checked model (the offline one of every built-in size)."""
    if model.startswith("builtin:"):
        return build_tokenizer()
    folder = store.get_dir(model, cache_dir=cache)
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        folder, local_files_only=True
    )
    return tokenizer


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def artifact_cache(scratch_dir: Path) -> Path:
    """Where model folders and checkpoints from non-file stores are downloaded, once each."""
    return scratch_dir / ".artifact-cache"


def checkpoint_version(job_id: str, step: int) -> str:
    """The version name of a job's checkpoint at `step`: ``<job id>-step-000120``."""
    return f"{job_id}-step-{step:06d}"


class JobRunner:
    """The controller's half of a running job: its worker group (see the module docstring)."""

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
        workers: WorkerGroupConfig | None = None,
        ray: RayWorkers | None = None,
        transport: RankTransport | None = None,
        validation: api.ValidationProgress | None = None,
    ) -> None:
        """Start the job's ranks (slow: each loads the model and builds its engine); with
        `resume_from`, a checkpoint's URL, they restore its weights, optimizer, schedule and
        step. `validation` is what the job's record holds of its validation (`plan_validation`'s
        held-out tasks, and the evaluations so far when resuming).

        `checkpoint_url` is this job's folder in the store (``<checkpoint_url>/<job id>``);
        `scratch` a local folder of this process: checkpoints are written there before they
        are put in the store, downloads are cached there, and the run log is kept there.
        With `ray`, the ranks are Ray actors (`ray_workers.RayWorkerGroup`); otherwise
        `transport` starts them (default: local processes; `pod_workers.PodRanks`: on worker
        Pods).
        """
        self.job_id = job_id
        self.spec = spec
        self.mode = MODE_NAMES[spec.mode]
        self.store = store
        self.checkpoint_url = checkpoint_url
        self.scratch = scratch
        self._metrics = recorder
        self.cancelled = False
        config = workers or WorkerGroupConfig()
        self.ranks = spec.ranks or config.ranks
        # The ranks read local folders only: the store is this process's.
        model = spec.model
        if not model.startswith("builtin:"):
            model = str(store.get_dir(model, cache_dir=self._cache))
        dataset = validation_set = None
        scratch.mkdir(parents=True, exist_ok=True)
        if spec.dataset:
            dataset = scratch / "dataset.jsonl"
            with store.open_read(spec.dataset) as source, dataset.open("wb") as target:
                shutil.copyfileobj(source, target)
        self.validation: ValidationTracker | None = None
        self.kept: list[StoredCheckpoint] = []
        """Checkpoints of new best validation losses saved during steps, not yet recorded."""
        if spec.HasField("validation"):
            progress = api.ValidationProgress()
            progress.CopyFrom(validation or api.ValidationProgress())
            self.validation = ValidationTracker(spec.validation, progress)
            validation_set = scratch / "validation.jsonl"
            if spec.validation.dataset:
                with (
                    store.open_read(spec.validation.dataset) as source,
                    validation_set.open("wb") as target,
                ):
                    shutil.copyfileobj(source, target)
                with validation_set.open(encoding="utf-8") as lines:
                    rows = parse_trajectories(lines, spec.validation.dataset)
                    progress.trajectories = sum(1 for _ in rows)
            elif dataset is not None:  # a fraction: resolve_spec asks for spec.dataset
                progress.trajectories = _hold_out(dataset, validation_set, progress.held_out_tasks)
        teacher = spec.distillation.teacher or None
        if teacher is not None and not teacher.startswith("builtin:"):
            teacher = str(store.get_dir(teacher, cache_dir=self._cache))
        resume = None
        if resume_from is not None:
            resume = str(store.get_dir(resume_from, cache_dir=self._cache))
        setup = RankSetup(
            job_id=job_id,
            spec=spec.SerializeToString(),
            model=model,
            scratch=str(scratch),
            rank=0,
            world_size=self.ranks,
            master_addr="127.0.0.1",
            master_port=0,
            dataset=None if dataset is None else str(dataset),
            dataset_name=spec.dataset,
            validation_dataset=None if validation_set is None else str(validation_set),
            resume_from=resume,
            teacher=teacher,
        )
        self.group: WorkerGroup | RayWorkerGroup
        try:
            if ray is None:
                self.group, ready = WorkerGroup.start(
                    job_id, setup, replace(config, ranks=self.ranks), transport=transport
                )
            else:
                from orchard.trainer.ray_workers import RayWorkerGroup  # noqa: PLC0415

                self.group, ready = RayWorkerGroup.start(
                    job_id, setup, replace(config, ranks=self.ranks), ray.placement, ray.runtime
                )
        except RankError as exc:
            raise JobStartError(f"rank {exc.rank} could not start: {exc}") from None
        finally:
            for copy in (dataset, validation_set):
                if copy is not None:
                    copy.unlink(missing_ok=True)
        self.step = ready.step
        self.buffered = ready.buffered
        if self.validation is not None:
            self.validation.progress.samples = ready.validation_samples
            self.validation.progress.training_samples = ready.buffered
        try:
            self._restore_run_log()
            self.run_log = StepRecorder(scratch / "run.jsonl")
        except BaseException:
            self.group.close()
            raise

    @property
    def _cache(self) -> Path:
        return artifact_cache(self.scratch.parent)

    @property
    def steps_left(self) -> int:
        return self.spec.total_steps - self.step

    @property
    def stopped_early(self) -> bool:
        """Early stopping ended the job: no steps are left to take."""
        return self.validation is not None and self.validation.stopped_early

    def _call(self, command: str, **arguments: object) -> Any:
        try:
            return self.group.call(command, **arguments)
        except RankError as exc:
            raise _fault(exc) from None

    def submit(
        self, group: trajectory_pb2.TrajectoryGroup, version_lag: VersionLag | None = None
    ) -> SubmitCounts:
        """Add one group's samples to every rank's buffer; raises `ValueError` (or
        `TrajectoryError`) for a malformed trajectory and `StaleBatchError` for one sampled by
        weights older than `spec.max_staleness` allows (`version_lag`: the lag of each weight
        version the group names), adding nothing of the group."""
        counts: SubmitCounts = self._call(
            "submit", group=group.SerializeToString(), version_lag=version_lag
        )
        self.buffered += counts.trainable
        return counts

    def run_steps(
        self, steps: int, on_step: Callable[[StepResult], None] | None = None
    ) -> list[StepResult]:
        """Train `steps` optimizer steps on the buffer; SFT stops early when cancelled."""
        results: list[StepResult] = []
        if self.mode == "sft":
            for _ in range(steps):
                if self.cancelled or self.stopped_early:
                    break
                results.extend(self._call("run_steps", steps=1))
                self._after(results[-1:], on_step)
                self._track(results[-1])
            return results
        needed = steps * self.spec.gradient_accumulation * self.ranks
        if self.buffered < needed:
            raise NotEnoughData(
                f"{steps} RL step(s) with gradient_accumulation "
                f"{self.spec.gradient_accumulation} on {self.ranks} rank(s) need at least "
                f"{needed} trainable samples; {self.buffered} are buffered: submit more groups"
            )
        results = self._call("run_steps", steps=steps)
        self.buffered = 0
        self._after(results, on_step)
        return results

    def _after(
        self, results: list[StepResult], on_step: Callable[[StepResult], None] | None
    ) -> None:
        for result in results:
            self.step = result.step
            self._record(result)
            if on_step is not None:
                on_step(result)

    def _track(self, result: StepResult) -> None:
        """Record the step's evaluation; keep a checkpoint of a new best (`kept`)."""
        loss = result.validation
        if loss is None or self.validation is None:
            return
        if self.validation.record(result.step, loss.epoch, loss.loss, loss.loss_tokens):
            self.kept.append(self.save({"validation_loss": repr(loss.loss)}))

    def take_kept(self) -> list[StoredCheckpoint]:
        """The best-loss checkpoints saved since the last call."""
        kept, self.kept = self.kept, []
        return kept

    def _record(self, result: StepResult) -> None:
        extra = None if result.validation is None else {"validation_loss": result.validation.loss}
        record = StepRecord.of(self.job_id, self.mode, result, extra)
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
        try:
            info: CheckpointInfo = self._call(
                "save",
                version=version,
                metadata={
                    "job": self.job_id,
                    "mode": self.mode,
                    "ranks": str(self.ranks),
                    **(metadata or {}),
                },
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
        """Stop every rank (idempotent)."""
        self.group.close()
        self.run_log.close()


def _hold_out(dataset: Path, validation: Path, tasks: Sequence[str]) -> int:
    """Move the rows of `tasks` from the `dataset` file to the `validation` file; returns how
    many moved."""
    with dataset.open(encoding="utf-8") as lines:
        train, held_out = split_by_task(parse_trajectories(lines, str(dataset)), tasks)
    write_trajectories(dataset, train)
    return write_trajectories(validation, held_out)


def _fault(error: RankError) -> Exception:
    """The exception a rank's fault stands for, as the service maps it to a status."""
    fault = error.fault
    known: dict[str, type[Exception]] = {
        "NotEnoughData": NotEnoughData,
        "StaleBatchError": StaleBatchError,
        "TrajectoryError": TrajectoryError,
        "ValueError": ValueError,
        "CheckpointError": CheckpointError,
    }
    kind = known.get(fault.kind)
    if kind is not None:
        return kind(fault.message)
    if fault.trace:
        log.error("rank %d failed:\n%s", error.rank, fault.trace)
    return RankFailed(f"rank {error.rank}: {fault.message}")
