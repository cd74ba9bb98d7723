"""SFT validation over real gRPC with a real etcd: the job evaluates the loss of a held-out set
(its own dataset, or whole tasks held out of the job's dataset with the job's seed) as it trains,
keeps a checkpoint of the best evaluation, stops early when told, and refuses settings it
cannot honour."""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from orchard.core.artifacts import ArtifactsConfig, ArtifactStore
from orchard.core.config import ServerConfig
from orchard.lm.model_folder import load_model_folder
from orchard.trainer.batch import collate
from orchard.trainer.config import EtcdConfig, TrainerConfig, WeightsConfig, WorkersConfig
from orchard.trainer.datasets import write_trajectories
from orchard.trainer.losses import sft_loss_and_logp
from orchard.trainer.masks import SampleConfig, build_sft_samples
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.trainer.validation import ValidationSetError, hold_out_tasks, split_by_task
from orchard.types.v1 import trajectory_pb2

from .conftest import TrajectoryBuilder
from .test_service import Trainer, failure, local, sft_spec

State = api.TrainingJobState

BOS, SEP, END = 1, 2, 3


def answers(
    prompts: Sequence[int], first: Sequence[int], prefix: str
) -> list[trajectory_pb2.Trajectory]:
    """One successful row per prompt token `a`, each its own task: prompt [BOS, a, SEP],
    answer [*first, 30, 31, END]."""
    build = TrajectoryBuilder()
    return [
        build(
            [build.Turn(inputs=[BOS, a, SEP], outputs=[*first, 30, 31, END])],
            trajectory_id=f"{prefix}{k}",
            task_id=f"{prefix}task-{k}",
        )
        for k, a in enumerate(prompts)
    ]


TRAIN = answers(range(10, 18), [40, 42], "train-")
# Other prompts answered with the same ending and another start: learning the ending helps
# them at first, memorizing the start hurts them more and more.
CONFLICTING = answers(range(20, 28), [41, 43], "validate-")


def put(store: ArtifactStore, name: str, rows: Sequence[trajectory_pb2.Trajectory]) -> str:
    path = Path(local(store.url("staging", name)))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trajectories(path, rows)
    return store.url("staging", name)


def validation_nll(model_url: str, rows: Sequence[trajectory_pb2.Trajectory]) -> float:
    """The mean NLL per loss token of `rows` under the model folder at `model_url`, computed
    here from scratch."""
    model = load_model_folder(local(model_url)).model.eval()
    samples = build_sft_samples(rows, SampleConfig()).samples
    batch = collate(samples, pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits
        loss, _ = sft_loss_and_logp(logits, batch.targets, batch.loss_mask)
    return float(loss)


async def job_of(t: Any, job_id: str) -> api.TrainingJob:
    job: api.TrainingJob = (
        await t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=job_id))
    ).job
    return job


@pytest.fixture
def configure(etcd, tmp_path: Path) -> Callable[..., TrainerConfig]:
    namespace = f"test/{uuid.uuid4().hex}/"

    def make(ranks: int = 1, **_: Any) -> TrainerConfig:
        return TrainerConfig(
            server=ServerConfig(listen=["127.0.0.1:0"], metrics_address="127.0.0.1:0"),
            etcd=EtcdConfig(
                endpoints=[etcd.endpoint], prefix=namespace + "trainer/", weights_prefix=namespace
            ),
            artifacts=ArtifactsConfig(root=(tmp_path / "store").as_uri()),
            weights=WeightsConfig(scratch_dir=str(tmp_path / "scratch")),
            workers=WorkersConfig(ranks=ranks, stop_timeout_s=5.0),
        )

    return make


@pytest.fixture
async def trainer(configure) -> AsyncIterator[Trainer]:
    running = Trainer(configure)
    try:
        yield running
    finally:
        await running.close()


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore((tmp_path / "store").as_uri())


async def test_the_best_checkpoint_is_the_lowest_validation_loss_while_training_loss_falls(
    trainer, store: ArtifactStore
):
    """Memorizing 8 rows: the training loss keeps falling while the loss on rows with the
    same ending and a conflicting start falls (the ending), then rises. Evaluated once per
    epoch (2 steps); the kept checkpoint is the lowest point, whose weights give that loss."""
    t = await trainer.start()
    spec = sft_spec(
        dataset=put(store, "train.jsonl", TRAIN),
        total_steps=24,
        learning_rate=1e-2,
        validation=api.ValidationConfig(dataset=put(store, "validate.jsonl", CONFLICTING)),
    )
    job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
    assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
    steps = (await t.stub.Step(api.StepRequest(job_id=job.id, steps=24))).steps
    evaluated = [s for s in steps if s.HasField("validation_loss")]
    assert [s.step for s in evaluated] == list(range(2, 25, 2))  # each epoch's end
    assert steps[-1].loss < steps[1].loss / 4  # memorized

    done = await job_of(t, job.id)
    assert done.state == State.TRAINING_JOB_STATE_SUCCEEDED
    progress = done.validation
    assert (progress.trajectories, progress.samples, progress.training_samples) == (8, 8, 8)
    assert [p.step for p in progress.points] == [s.step for s in evaluated]
    assert [p.loss for p in progress.points] == [s.validation_loss for s in evaluated]
    assert [p.epoch for p in progress.points] == [float(k) for k in range(1, 13)]
    losses = [p.loss for p in progress.points]
    best = min(range(len(losses)), key=losses.__getitem__)
    assert 0 < best < len(losses) - 1, losses  # down first, then up
    assert losses[-1] > losses[best] + 0.3, losses
    assert (progress.best_step, progress.best_loss) == (progress.points[best].step, losses[best])
    assert not progress.stopped_early
    assert all(p.loss_tokens == 8 * 5 for p in progress.points)  # 5 answer tokens a row
    gauge = t.metric("orchard_trainer_validation_loss_ratio", job=job.id, mode="sft")
    assert gauge == pytest.approx(losses[-1])

    # A checkpoint at each new best, and the last step's; the best one holds those weights.
    listed = await t.stub.ListCheckpoints(api.ListCheckpointsRequest(job_id=job.id))
    kept = {c.step: c for c in listed.checkpoints}
    assert progress.best_step in kept and 24 in kept
    assert all(s in {p.step for p in progress.points} for s in kept)
    best_model = f"{kept[progress.best_step].uri}/model"
    assert validation_nll(best_model, CONFLICTING) == pytest.approx(progress.best_loss, rel=1e-4)
    assert validation_nll(f"{kept[24].uri}/model", CONFLICTING) == pytest.approx(losses[-1], 1e-4)
    published = await t.stub.PublishCheckpoint(
        api.PublishCheckpointRequest(job_id=job.id, step=progress.best_step)
    )
    assert published.checkpoint.weight_version.endswith(f"-step-{progress.best_step:06d}")


async def test_early_stopping_ends_the_job_at_its_patience(trainer, store: ArtifactStore):
    t = await trainer.start()
    spec = sft_spec(
        dataset=put(store, "train.jsonl", TRAIN),
        total_steps=40,
        learning_rate=1e-2,
        validation=api.ValidationConfig(
            dataset=put(store, "validate.jsonl", CONFLICTING), interval_steps=2, patience=2
        ),
    )
    job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
    steps = (await t.stub.Step(api.StepRequest(job_id=job.id, steps=40))).steps
    done = await job_of(t, job.id)
    progress = done.validation
    assert done.state == State.TRAINING_JOB_STATE_SUCCEEDED and progress.stopped_early
    # Two evaluations after the best, none better, then nothing more.
    assert [p.step for p in progress.points][-3:] == [
        progress.best_step,
        progress.best_step + 2,
        progress.best_step + 4,
    ]
    assert all(p.loss >= progress.best_loss for p in progress.points)
    assert steps[-1].step == progress.best_step + 4 < 40
    assert done.last_step.step == steps[-1].step
    code, message = await failure(t.stub.Step(api.StepRequest(job_id=job.id, steps=1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"early stopping ended it at step {steps[-1].step}" in message
    assert f"best checkpoint is at step {progress.best_step}" in message


async def test_a_fraction_holds_whole_tasks_out_with_the_job_s_seed(trainer, store: ArtifactStore):
    """Two rows per task: a fraction of 0.25 holds 2 of the 8 tasks out, both rows of each, the
    same ones for the same seed; the validation loss is the held-out rows' own. On two ranks,
    which share the validation micro-batches (one here: the second rank runs it uncounted)."""
    t = await trainer.start(ranks=2)
    build = TrajectoryBuilder()
    rows = []
    for k in range(8):
        for copy in range(2):
            turn = build.Turn(inputs=[BOS, 10 + k, SEP], outputs=[11 + k + copy, 40, END])
            rows.append(build([turn], trajectory_id=f"r{k}-{copy}", task_id=f"task-{k}"))
    dataset = put(store, "tasks.jsonl", rows)

    async def held_out(seed: int) -> api.TrainingJob:
        spec = sft_spec(
            dataset=dataset,
            total_steps=3,
            seed=seed,
            validation=api.ValidationConfig(fraction=0.25),
        )
        job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
        assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
        await t.stub.Step(api.StepRequest(job_id=job.id, steps=3))
        return await job_of(t, job.id)

    first = await held_out(seed=7)
    tasks = list(first.validation.held_out_tasks)
    assert len(tasks) == 2 and tasks == sorted(tasks)
    assert (first.validation.trajectories, first.validation.samples) == (4, 4)
    assert first.validation.training_samples == 12
    # 12 samples in micro-batches of 4, two a step: an epoch ends within step 2, and step 3
    # is the last.
    points = [(p.step, p.epoch, p.loss_tokens) for p in first.validation.points]
    assert points == [(2, pytest.approx(4 / 3), 4 * 3), (3, 2.0, 4 * 3)]
    last = (await t.stub.ListCheckpoints(api.ListCheckpointsRequest(job_id=first.id))).checkpoints
    validation_rows = [r for r in rows if r.task_id in tasks]
    assert validation_nll(f"{last[-1].uri}/model", validation_rows) == pytest.approx(
        first.validation.points[-1].loss, rel=1e-4
    )
    assert list((await held_out(seed=7)).validation.held_out_tasks) == tasks


def test_held_out_tasks_are_whole_drawn_by_seed_and_never_all() -> None:
    build = TrajectoryBuilder()
    rows = []
    for k in range(10):
        turn = build.Turn(inputs=[BOS, 10 + k, SEP], outputs=[11 + k, END])
        rows += [build([turn], trajectory_id=f"r{k}-{c}", task_id=f"t{k}") for c in range(3)]
    # A task whose only row failed without rise segments gives no sample: never held out.
    failed = build([build.Turn(inputs=[BOS, 5, SEP], outputs=[6])], reward=0.0, task_id="dud")
    rows.append(failed)
    draws = {tuple(hold_out_tasks(rows, 0.2, seed, SampleConfig())) for seed in range(20)}
    assert all(len(d) == 2 and "dud" not in d for d in draws)
    assert len(draws) > 5  # the seed decides
    assert hold_out_tasks(rows, 0.2, 4, SampleConfig()) == hold_out_tasks(
        rows, 0.2, 4, SampleConfig()
    )
    assert len(hold_out_tasks(rows, 0.01, 0, SampleConfig())) == 1  # at least one
    assert len(hold_out_tasks(rows, 0.99, 0, SampleConfig())) == 9  # one left to train on
    train, validate = split_by_task(rows, ["t3"])
    assert [r.id for r in validate] == ["r3-0", "r3-1", "r3-2"]
    assert len(train) == len(rows) - 3
    with pytest.raises(ValidationSetError, match="needs at least two"):
        hold_out_tasks([*rows[:3], failed], 0.5, 0, SampleConfig())


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"validation": api.ValidationConfig(fraction=1.0)}, "fraction must be in [0, 1)"),
        ({"validation": api.ValidationConfig(fraction=-0.1)}, "fraction must be in [0, 1)"),
        ({"validation": api.ValidationConfig(fraction=math.nan)}, "fraction must be in [0, 1)"),
        (
            {"validation": api.ValidationConfig(fraction=0.2, dataset="file:///v.jsonl")},
            "a dataset or a fraction",
        ),
        ({"validation": api.ValidationConfig(fraction=0.2, patience=-1)}, "patience"),
        ({"validation": api.ValidationConfig(fraction=0.2, interval_steps=-2)}, "interval_steps"),
        ({"validation": api.ValidationConfig(fraction=0.2, min_delta=-1.0)}, "min_delta"),
        ({"validation": api.ValidationConfig(patience=3)}, "no validation set"),
        (
            {"validation": api.ValidationConfig(fraction=0.2), "mode": api.TRAINING_MODE_RL},
            "for SFT jobs",
        ),
    ],
)
async def test_bad_validation_settings_are_refused(
    trainer, store: ArtifactStore, fields: dict[str, Any], words: str
):
    t = await trainer.start()
    if "mode" not in fields:  # RL jobs take no dataset
        fields = {"dataset": put(store, "train.jsonl", TRAIN), **fields}
    spec = sft_spec(**fields)
    code, message = await failure(t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in message and "spec.validation" in message


async def test_a_set_that_cannot_validate_is_refused_before_the_job_starts(
    trainer, store: ArtifactStore
):
    t = await trainer.start()
    one_task = answers([10, 11], [40], "only-")
    for row in one_task:
        row.task_id = "the-one-task"
    spec = sft_spec(
        dataset=put(store, "one.jsonl", one_task),
        validation=api.ValidationConfig(fraction=0.5),
    )
    code, message = await failure(t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "1 task(s) with SFT samples: it needs at least two" in message
    no_fraction = sft_spec(validation=api.ValidationConfig(fraction=0.5))
    code, message = await failure(
        t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=no_fraction))
    )
    assert (code, "the job has none" in message) == (grpc.StatusCode.INVALID_ARGUMENT, True)
    # Failed rows without rise segments carry no loss token: nothing to validate on.
    failed = answers([10], [40], "failed-")
    failed[0].reward.value = 0.0
    spec = sft_spec(
        dataset=put(store, "train.jsonl", TRAIN),
        validation=api.ValidationConfig(dataset=put(store, "failed.jsonl", failed)),
    )
    code, message = await failure(t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "gives no SFT sample" in message
    jobs = await t.stub.ListTrainingJobs(api.ListTrainingJobsRequest())
    assert not jobs.jobs  # refused before any record


async def test_the_same_seed_trains_the_same_steps_exactly(trainer, store: ArtifactStore):
    """The seed decides the held-out tasks, the sample order and torch's draws: the same spec
    and seed give bit-identical losses, another seed other ones."""
    t = await trainer.start()
    dataset = put(store, "train.jsonl", TRAIN)

    async def run(seed: int) -> tuple[list[float], list[float], list[str]]:
        spec = sft_spec(
            dataset=dataset,
            total_steps=6,
            seed=seed,
            validation=api.ValidationConfig(fraction=0.25, interval_steps=2),
        )
        job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
        steps = (await t.stub.Step(api.StepRequest(job_id=job.id, steps=6))).steps
        held_out = list((await job_of(t, job.id)).validation.held_out_tasks)
        return [s.loss for s in steps], [s.validation_loss for s in steps[1::2]], held_out

    first = await run(seed=3)
    assert await run(seed=3) == first
    other = await run(seed=4)
    assert other[0] != first[0]
