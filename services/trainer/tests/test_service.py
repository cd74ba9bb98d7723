"""The TrainerService over real gRPC on 127.0.0.1 with a real etcd: SFT and RL jobs, batches,
steps, checkpoints, publication to the weight registry, cancel, restart survival, bad input,
and the metrics on the server's real /metrics endpoint."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchard.core.artifacts import ArtifactsConfig
from orchard.core.config import ServerConfig
from orchard.core.errors import error_info
from orchard.core.etcd import EtcdStore
from orchard.lm.model_folder import load_model_folder
from orchard.lm.weights import WeightRegistry
from orchard.trainer.config import EtcdConfig, JobsConfig, TrainerConfig, WeightsConfig
from orchard.trainer.main import TrainerApplication
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.trainer.v1 import trainer_service_pb2_grpc
from orchard.types.v1 import trajectory_pb2

from .conftest import TrajectoryBuilder, synthetic_trajectories

State = api.TrainingJobState


class Running:
    def __init__(self, app: TrainerApplication, metrics_address: str, channel: Any) -> None:
        self.app = app
        self.metrics_address = metrics_address
        self.stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)

    def metric(self, name: str, **labels: str) -> float:
        """The current value of one sample on the real /metrics endpoint (0 when absent)."""
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=5) as r:
            text = r.read().decode()
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            sample, value = line.rsplit(" ", 1)
            metric_name, _, rest = sample.partition("{")
            found = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
            if metric_name == name and found == wanted:
                return float(value)
        return 0.0


Start = Callable[..., Any]


@pytest.fixture
def trainer_config(etcd, tmp_path: Path) -> Callable[..., TrainerConfig]:
    namespace = f"test/{uuid.uuid4().hex}/"

    def make(**jobs: Any) -> TrainerConfig:
        return TrainerConfig(
            server=ServerConfig(listen=["127.0.0.1:0"], metrics_address="127.0.0.1:0"),
            etcd=EtcdConfig(
                endpoints=[etcd.endpoint], prefix=namespace + "trainer/", weights_prefix=namespace
            ),
            artifacts=ArtifactsConfig(root=(tmp_path / "store").as_uri()),
            weights=WeightsConfig(scratch_dir=str(tmp_path / "scratch")),
            jobs=JobsConfig(**jobs),
        )

    return make


class Trainer:
    """Starts and stops service instances on one configuration (restarts keep etcd)."""

    def __init__(self, make: Callable[..., TrainerConfig]) -> None:
        self.make = make
        self._servers: list[Any] = []

    async def start(self, **jobs: Any) -> Running:
        app = TrainerApplication(self.make(**jobs))
        server = app.server()
        await server.start()
        await server.set_serving()
        channel = grpc.aio.insecure_channel(server.addresses[0])
        self._servers.append((server, channel))
        assert server.metrics_address is not None
        return Running(app, server.metrics_address, channel)

    async def stop_last(self) -> None:
        server, channel = self._servers.pop()
        await channel.close()
        await server.stop()

    async def close(self) -> None:
        while self._servers:
            await self.stop_last()


@pytest.fixture
async def trainer(trainer_config) -> AsyncIterator[Trainer]:
    running = Trainer(trainer_config)
    try:
        yield running
    finally:
        await running.close()


@pytest.fixture
async def registry(trainer_config) -> AsyncIterator[WeightRegistry]:
    config = trainer_config()
    async with EtcdStore(config.etcd.endpoints, namespace=config.etcd.weights_prefix) as store:
        yield WeightRegistry(store, "policy")
        await store.delete_prefix("")


def local(url: str) -> Path:
    """The folder a file:// artifact URL names."""
    assert url.startswith("file:///"), url
    return Path(url.removeprefix("file://"))


def sft_spec(**fields: Any) -> api.TrainingJobSpec:
    spec = dict(
        mode=api.TRAINING_MODE_SFT,
        model="builtin:tiny",
        learning_rate=3e-3,
        total_steps=6,
        micro_batch_size=4,
    )
    spec.update(fields)
    return api.TrainingJobSpec(**spec)


def groups(n: int, per_group: int, seed: int = 0) -> list[trajectory_pb2.TrajectoryGroup]:
    trajectories = synthetic_trajectories(n * per_group, seed)
    return [
        trajectory_pb2.TrajectoryGroup(
            id=f"g{k}", trajectories=trajectories[k * per_group : (k + 1) * per_group]
        )
        for k in range(n)
    ]


async def submit(
    stub: Any, job_id: str, batch: Sequence[trajectory_pb2.TrajectoryGroup]
) -> api.SubmitGroupsResponse:
    async def messages() -> AsyncIterator[api.SubmitGroupsRequest]:
        for group in batch:
            yield api.SubmitGroupsRequest(job_id=job_id, group=group)

    response: api.SubmitGroupsResponse = await stub.SubmitGroups(messages())
    return response


async def failure(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert error_info(caught.value) is not None
    return caught.value.code(), caught.value.details() or ""


async def test_an_sft_job_trains_checkpoints_publishes_and_finishes(trainer, registry):
    t = await trainer.start()
    created = await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=sft_spec()))
    job = created.job
    assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
    assert job.spec.gradient_accumulation == 1  # defaults filled in
    assert job.spec.policy_loss.clip_high == pytest.approx(0.28)

    code, message = await failure(t.stub.Step(api.StepRequest(job_id=job.id, steps=1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "submit groups" in message

    accepted = await submit(t.stub, job.id, groups(2, 8))
    assert (accepted.groups_accepted, accepted.trajectories_trainable) == (2, 16)
    assert accepted.trajectories_skipped == 0

    stepped = await t.stub.Step(api.StepRequest(job_id=job.id, steps=3))
    assert [s.step for s in stepped.steps] == [1, 2, 3]
    assert stepped.steps[-1].loss < stepped.steps[0].loss
    assert all(s.loss_tokens > 0 for s in stepped.steps)
    assert "entropy" in stepped.steps[0].extra
    assert stepped.weight_version == ""
    got = (await t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=job.id))).job
    assert got.last_step.step == 3
    assert got.last_step.loss == pytest.approx(stepped.steps[-1].loss)

    saved = (await t.stub.SaveCheckpoint(api.SaveCheckpointRequest(job_id=job.id))).checkpoint
    assert (saved.step, saved.weight_version) == (3, "")
    assert saved.uri.startswith("file://") and "/store/checkpoints/" in saved.uri
    assert load_model_folder(local(saved.uri) / "model").metadata["step"] == "3"
    again = (await t.stub.SaveCheckpoint(api.SaveCheckpointRequest(job_id=job.id))).checkpoint
    assert again == saved
    assert await registry.latest() is None  # saved, not published

    published = await t.stub.PublishCheckpoint(api.PublishCheckpointRequest(job_id=job.id, step=3))
    version = published.checkpoint.weight_version
    assert version == f"{job.id}-step-000003"
    latest = await registry.latest()
    assert latest is not None
    assert (latest.version, latest.metadata["job"], latest.metadata["step"]) == (
        version,
        job.id,
        "3",
    )
    assert latest.location == f"{saved.uri}/model"

    code, message = await failure(t.stub.Step(api.StepRequest(job_id=job.id, steps=4)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "at most 3 step(s) left" in message

    last = await t.stub.Step(api.StepRequest(job_id=job.id, steps=3, publish=True))
    assert [s.step for s in last.steps] == [4, 5, 6]
    assert last.weight_version == f"{job.id}-step-000006"
    assert (await registry.latest()).version == last.weight_version
    done = (await t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=job.id))).job
    assert done.state == State.TRAINING_JOB_STATE_SUCCEEDED
    assert done.weight_version == last.weight_version
    listed = await t.stub.ListCheckpoints(api.ListCheckpointsRequest(job_id=job.id))
    assert [(c.step, c.weight_version) for c in listed.checkpoints] == [
        (3, version),
        (6, last.weight_version),
    ]
    code, message = await failure(t.stub.Step(api.StepRequest(job_id=job.id, steps=1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "SUCCEEDED" in message

    assert t.metric("orchard_trainer_steps_total", job=job.id, mode="sft") == 6
    assert t.metric("orchard_trainer_publications_total", mode="sft") == 2
    assert t.metric("orchard_trainer_checkpoints_total", mode="sft") == 2
    assert t.metric("orchard_trainer_jobs_total", mode="sft", state="succeeded") == 1
    assert t.metric("orchard_trainer_groups_submitted_total", mode="sft") == 2
    assert t.metric("orchard_trainer_loss_ratio", job=job.id, mode="sft") == pytest.approx(
        last.steps[-1].loss
    )
    assert t.metric("orchard_trainer_running_jobs") == 0
    run_log = t.app.config.weights.scratch_dir / Path(job.id) / "run.jsonl"
    assert len(run_log.read_text().splitlines()) == 6


async def test_an_rl_job_steps_on_scored_groups(trainer):
    t = await trainer.start()
    spec = api.TrainingJobSpec(
        mode=api.TRAINING_MODE_RL, model="builtin:tiny", total_steps=4, micro_batch_size=2
    )
    job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
    build = TrajectoryBuilder()

    def turns(*outputs: int) -> list[Any]:
        return [build.Turn(inputs=[1, 11, 12, 2], outputs=list(outputs))]

    group = trajectory_pb2.TrajectoryGroup(
        id="g0",
        trajectories=[
            build(turns(13, 14, 3), trajectory_id="a", reward=1.0),
            build(turns(15, 16, 3), trajectory_id="b", reward=0.0),
            build(turns(17, 3), trajectory_id="c", reward=0.0, excluded=True),
        ],
    )
    accepted = await submit(t.stub, job.id, [group])
    assert (accepted.trajectories_trainable, accepted.trajectories_skipped) == (2, 1)
    code, message = await failure(t.stub.Step(api.StepRequest(job_id=job.id, steps=3)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "need at least 3 trainable samples; 2 are buffered" in message
    stepped = await t.stub.Step(api.StepRequest(job_id=job.id, steps=1))
    (metrics,) = stepped.steps
    assert metrics.step == 1
    assert {"clip_fraction", "importance_mean", "entropy", "reward_mean"} <= set(metrics.extra)
    assert metrics.extra["reward_mean"] == pytest.approx(0.5)
    # The buffer was consumed by the step.
    code, _ = await failure(t.stub.Step(api.StepRequest(job_id=job.id, steps=1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert (
        t.metric("orchard_trainer_trajectories_submitted_total", mode="rl", outcome="skipped") == 1
    )


@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
async def test_an_rl_job_s_kl_penalty_measures_the_policy_against_its_starting_one(
    trainer, kl_coef: float
):
    """With kl_coef > 0 the ranks hold a frozen copy of the starting policy: the first update
    is at the reference (KL 0), the next has moved away from it (KL > 0). Without it nothing
    is measured (no reference is loaded)."""
    t = await trainer.start()
    spec = api.TrainingJobSpec(
        mode=api.TRAINING_MODE_RL,
        model="builtin:tiny",
        total_steps=4,
        micro_batch_size=2,
        learning_rate=5e-3,
        policy_loss=api.PolicyLossConfig(clip_low=0.2, clip_high=0.2, kl_coef=kl_coef),
    )
    job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
    build = TrajectoryBuilder()

    def group(name: str) -> trajectory_pb2.TrajectoryGroup:
        def turns(*outputs: int) -> list[Any]:
            return [build.Turn(inputs=[1, 11, 12, 2], outputs=list(outputs))]

        return trajectory_pb2.TrajectoryGroup(
            id=name,
            trajectories=[
                build(turns(13, 14, 3), trajectory_id=f"{name}a", reward=1.0),
                build(turns(15, 16, 3), trajectory_id=f"{name}b", reward=0.0),
            ],
        )

    kls = []
    for name in ("g0", "g1"):
        await submit(t.stub, job.id, [group(name)])
        (metrics,) = (await t.stub.Step(api.StepRequest(job_id=job.id, steps=1))).steps
        kls.append(metrics.extra["kl_mean"])
    if kl_coef == 0.0:
        assert kls == [0.0, 0.0]
    else:
        assert kls[0] == pytest.approx(0.0, abs=1e-6)
        assert kls[1] > 1e-5, kls


@pytest.mark.parametrize(("threshold", "trainable"), [(None, 1), (0.6, 1), (0.75, 0)])
async def test_an_sft_job_trains_every_turn_only_of_trajectories_at_its_success_threshold(
    trainer, threshold: float | None, trainable: int
):
    """A reward of 0.6 is a success at the default 0.5 and at 0.6 (the edge counts), and a
    failure at 0.75: with no credited turns a failure has nothing to train."""
    t = await trainer.start()
    spec = api.TrainingJobSpec(mode=api.TRAINING_MODE_SFT, model="builtin:tiny", total_steps=1)
    if threshold is not None:
        spec.success_threshold = threshold
    job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
    build = TrajectoryBuilder()
    turns = [build.Turn(inputs=[1, 11, 12, 2], outputs=[13, 14, 3])]
    group = trajectory_pb2.TrajectoryGroup(
        id="g", trajectories=[build(turns, trajectory_id="a", reward=0.6)]
    )
    accepted = await submit(t.stub, job.id, [group])
    assert accepted.trajectories_trainable == trainable


async def test_an_sft_job_s_success_threshold_outside_0_1_is_refused(trainer):
    t = await trainer.start()
    spec = api.TrainingJobSpec(
        mode=api.TRAINING_MODE_SFT, model="builtin:tiny", success_threshold=1.5
    )
    code, message = await failure(t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.success_threshold must be a number in [0, 1], got 1.5" in message


async def test_cancel_keeps_checkpoints_and_refuses_more_work(trainer):
    t = await trainer.start()
    job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=sft_spec()))).job
    await submit(t.stub, job.id, groups(1, 4))
    await t.stub.Step(api.StepRequest(job_id=job.id, steps=1, publish=True))
    cancelled = (await t.stub.CancelTrainingJob(api.CancelTrainingJobRequest(job_id=job.id))).job
    assert cancelled.state == State.TRAINING_JOB_STATE_CANCELLED
    again = (await t.stub.CancelTrainingJob(api.CancelTrainingJobRequest(job_id=job.id))).job
    assert again.state == State.TRAINING_JOB_STATE_CANCELLED
    listed = await t.stub.ListCheckpoints(api.ListCheckpointsRequest(job_id=job.id))
    assert [c.step for c in listed.checkpoints] == [1]
    for call in (
        t.stub.Step(api.StepRequest(job_id=job.id, steps=1)),
        t.stub.SaveCheckpoint(api.SaveCheckpointRequest(job_id=job.id)),
        submit(t.stub, job.id, groups(1, 2)),
    ):
        code, message = await failure(call)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "CANCELLED" in message
    assert t.metric("orchard_trainer_running_jobs") == 0


async def test_a_restarted_service_lists_its_jobs_and_resumes_from_the_last_checkpoint(trainer):
    t = await trainer.start()
    job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=sft_spec()))).job
    batch = groups(2, 4)
    await submit(t.stub, job.id, batch)
    await t.stub.Step(api.StepRequest(job_id=job.id, steps=2))
    await t.stub.SaveCheckpoint(api.SaveCheckpointRequest(job_id=job.id))
    before = await t.stub.Step(api.StepRequest(job_id=job.id, steps=2))
    await trainer.stop_last()

    t = await trainer.start()
    listed = await t.stub.ListTrainingJobs(api.ListTrainingJobsRequest())
    assert [j.id for j in listed.jobs] == [job.id]
    resumed = listed.jobs[0]
    assert resumed.state == State.TRAINING_JOB_STATE_RUNNING
    assert resumed.last_step.step == 4  # the record remembers the last step taken
    checkpoints = await t.stub.ListCheckpoints(api.ListCheckpointsRequest(job_id=job.id))
    assert [c.step for c in checkpoints.checkpoints] == [2]
    # The buffer did not survive; the same data again gives the same steps 3 and 4.
    code, _ = await failure(t.stub.Step(api.StepRequest(job_id=job.id, steps=1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    await submit(t.stub, job.id, batch)
    after = await t.stub.Step(api.StepRequest(job_id=job.id, steps=2))
    assert [s.step for s in after.steps] == [3, 4]
    for a, b in zip(before.steps, after.steps, strict=True):
        assert b.loss == pytest.approx(a.loss, rel=1e-5)
        assert b.learning_rate == pytest.approx(a.learning_rate)
    await trainer.stop_last()

    t = await trainer.start(resume_on_start=False)
    failed = (await t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=job.id))).job
    assert failed.state == State.TRAINING_JOB_STATE_FAILED
    assert "interrupted by a restart" in failed.error
    assert "last checkpoint: step 2" in failed.error


async def test_bad_requests_get_actionable_statuses(trainer, tmp_path):
    t = await trainer.start(max_running=1)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (api.CreateTrainingJobRequest(), "spec is required"),
        (api.CreateTrainingJobRequest(spec=sft_spec(mode=0)), "spec.mode"),
        (api.CreateTrainingJobRequest(spec=sft_spec(model="builtin:huge")), "builtin:tiny"),
        (api.CreateTrainingJobRequest(spec=sft_spec(model=str(tmp_path))), "file://"),
        (api.CreateTrainingJobRequest(spec=sft_spec(zero_stage=4)), "zero_stage"),
        (api.CreateTrainingJobRequest(spec=sft_spec(learning_rate=-1)), "learning_rate"),
        (api.CreateTrainingJobRequest(spec=sft_spec(warmup_steps=9)), "warmup_steps"),
        (api.CreateTrainingJobRequest(spec=sft_spec(dataset="nope.jsonl")), "spec.dataset"),
    ]
    for request, needle in cases:
        code, message = await failure(t.stub.CreateTrainingJob(request))
        assert (code, needle in message) == (invalid, True), message

    code, message = await failure(t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id="x")))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "ListTrainingJobs" in message
    code, _ = await failure(t.stub.ListTrainingJobs(api.ListTrainingJobsRequest(page_size=-1)))
    assert code == invalid
    code, _ = await failure(t.stub.ListTrainingJobs(api.ListTrainingJobsRequest(page_token="z")))
    assert code == invalid

    request = api.CreateTrainingJobRequest(spec=sft_spec(), request_id="once")
    job = (await t.stub.CreateTrainingJob(request)).job
    assert (await t.stub.CreateTrainingJob(request)).job.id == job.id  # a retry
    code, message = await failure(
        t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=sft_spec()))
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "jobs.max_running" in message

    code, _ = await failure(t.stub.Step(api.StepRequest(job_id=job.id, steps=0)))
    assert code == invalid
    code, message = await failure(
        t.stub.PublishCheckpoint(api.PublishCheckpointRequest(job_id=job.id, step=7))
    )
    assert code == grpc.StatusCode.NOT_FOUND
    assert "SaveCheckpoint" in message

    build = TrajectoryBuilder()
    good, bad = groups(1, 2)[0], trajectory_pb2.TrajectoryGroup(id="bad")
    bad.trajectories.append(build([build.Turn(inputs=[1, 2], outputs=[5, 6], logprobs=[-1.0])]))
    code, message = await failure(submit(t.stub, job.id, [good, bad]))
    assert code == invalid
    assert "group 1 (bad)" in message
    assert "(1) were accepted" in message
    huge = trajectory_pb2.TrajectoryGroup(id="huge")
    huge.trajectories.append(build([build.Turn(inputs=[1, 99_999], outputs=[5])]))
    code, message = await failure(submit(t.stub, job.id, [huge]))
    assert code == invalid
    assert "vocabulary" in message
    other = (await t.stub.CreateTrainingJob(request)).job
    assert other.id == job.id

    async def mixed() -> AsyncIterator[api.SubmitGroupsRequest]:
        yield api.SubmitGroupsRequest(job_id=job.id, group=good)
        yield api.SubmitGroupsRequest(job_id="job-other", group=good)

    code, message = await failure(t.stub.SubmitGroups(mixed()))
    assert code == invalid
    assert "same job" in message


TRAINER = str(Path(sys.executable).parent / "orchard-trainer")


def _clean_env() -> dict[str, str]:
    launcher = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {
        k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_") and k not in launcher
    }


@pytest.mark.slow
def test_serve_needs_etcd_and_says_how_to_give_it() -> None:
    done = subprocess.run(
        [TRAINER, "serve", "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, env=_clean_env(), timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "etcd.endpoints is empty" in done.stderr


@pytest.mark.slow
def test_serve_runs_the_service_and_drains_on_sigterm(etcd, tmp_path: Path) -> None:
    socket_path = tmp_path / "trainer.sock"
    # Launcher variables left by whoever started it, MASTER_PORT on a port another process
    # holds: a job is a world of its own on a port of its own, so they cannot break it.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    environ = _clean_env() | {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(held.getsockname()[1]),
    }
    process = subprocess.Popen(
        [
            TRAINER, "serve", "--listen", f"unix:{socket_path}", "--etcd", etcd.endpoint,
            "--artifacts-root", (tmp_path / "store").as_uri(),
            "--scratch-dir", str(tmp_path / "scratch"), "--grace-period-s", "1",
            "--set", f"etcd.prefix=test/{uuid.uuid4().hex}/",
        ],
        stderr=subprocess.PIPE, env=environ,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(f"unix:{socket_path}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                assert process.poll() is None, process.stderr and process.stderr.read()
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, "orchard-trainer serve did not serve in 60 s"
                time.sleep(0.05)
            stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)
            assert list(stub.ListTrainingJobs(api.ListTrainingJobsRequest(), timeout=10).jobs) == []
            with pytest.raises(grpc.RpcError) as caught:
                stub.GetTrainingJob(api.GetTrainingJobRequest(job_id="job-none"), timeout=10)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            spec = api.TrainingJobSpec(mode=api.TRAINING_MODE_RL, model="builtin:tiny")
            request = api.CreateTrainingJobRequest(spec=spec)
            job = stub.CreateTrainingJob(request, timeout=120).job
            assert job.state == api.TRAINING_JOB_STATE_RUNNING, job.error
            stub.CancelTrainingJob(api.CancelTrainingJobRequest(job_id=job.id), timeout=30)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        held.close()
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_rl_groups_sampled_by_too_old_weights_are_refused_or_skipped(trainer, registry):
    t = await trainer.start()
    for name in ("v1", "v2", "v3"):
        await registry.publish(name, f"file:///models/{name}")
    build = TrajectoryBuilder()

    def trajectory(name: str, version: str, reward: float) -> trajectory_pb2.Trajectory:
        out = build([build.Turn(inputs=[1, 11, 2], outputs=[13 + len(name), 3])], reward=reward)
        out.id = name
        out.turns[0].weight_version = version
        return out

    def group(*members: trajectory_pb2.Trajectory) -> trajectory_pb2.TrajectoryGroup:
        return trajectory_pb2.TrajectoryGroup(id="g", trajectories=members)

    def rl_spec(**fields: Any) -> api.TrainingJobSpec:
        spec = {"mode": api.TRAINING_MODE_RL, "model": "builtin:tiny", "max_staleness": 1}
        return api.TrainingJobSpec(**{**spec, **fields})

    strict = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=rl_spec()))).job
    fresh = group(trajectory("a", "v3", 1.0), trajectory("bb", "v2", 0.0))
    accepted = await submit(t.stub, strict.id, [fresh])
    assert accepted.trajectories_trainable == 2
    code, message = await failure(
        submit(t.stub, strict.id, [group(trajectory("a", "v3", 1.0), trajectory("c", "v1", 0.0))])
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "2 versions behind" in message
    assert "skip_stale" in message
    code, message = await failure(submit(t.stub, strict.id, [group(trajectory("d", "local", 1.0))]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "unknown weight version" in message

    lenient = await t.stub.CreateTrainingJob(
        api.CreateTrainingJobRequest(spec=rl_spec(skip_stale=True))
    )
    mixed = group(
        trajectory("a", "v3", 1.0), trajectory("bb", "v2", 0.0), trajectory("c", "v1", 0.5)
    )
    accepted = await submit(t.stub, lenient.job.id, [mixed])
    assert (accepted.trajectories_trainable, accepted.trajectories_skipped) == (2, 1)

    code, message = await failure(
        t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=sft_spec(max_staleness=1)))
    )
    assert (code, "for RL jobs" in message) == (grpc.StatusCode.INVALID_ARGUMENT, True)
    code, message = await failure(
        t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=rl_spec(max_staleness=-1)))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def test_another_jobs_versions_do_not_make_a_jobs_groups_stale(trainer, registry):
    """Two RL jobs on one weight model (experiment arms that start from one SFT model): the
    versions the first publishes are not updates of the second's policy, so the second's
    groups, sampled by the version both started from, are fresh; the first's own updates do
    make its old samples stale."""
    t = await trainer.start()
    shared = registry.for_model("arms")
    await shared.publish("sft", "file:///models/sft")
    build = TrajectoryBuilder()

    def group(version: str) -> trajectory_pb2.TrajectoryGroup:
        members = []
        for name, token, reward in (("a", 14, 1.0), ("b", 15, 0.0)):
            member = build([build.Turn(inputs=[1, 11, 2], outputs=[token, 3])], reward=reward)
            member.id = f"{name}-{version}"
            member.turns[0].weight_version = version
            members.append(member)
        return trajectory_pb2.TrajectoryGroup(id=f"g-{version}", trajectories=members)

    def rl_spec() -> api.TrainingJobSpec:
        return api.TrainingJobSpec(
            mode=api.TRAINING_MODE_RL, model="builtin:tiny", max_staleness=0,
            weight_model="arms", total_steps=3,
        )  # fmt: skip

    first = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=rl_spec()))).job
    version = "sft"
    for _ in range(2):
        assert (await submit(t.stub, first.id, [group(version)])).trajectories_trainable == 2
        stepped = await t.stub.Step(api.StepRequest(job_id=first.id, steps=1, publish=True))
        version = stepped.weight_version
    assert (await shared.latest()).version == version  # two versions newer than "sft"

    second = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=rl_spec()))).job
    accepted = await submit(t.stub, second.id, [group("sft")])
    assert accepted.trajectories_trainable == 2
    code, message = await failure(submit(t.stub, first.id, [group("sft")]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "2 versions behind" in message


async def test_a_job_publishes_to_its_own_weight_model(trainer, registry):
    """`spec.weight_model` names the registry model a job publishes to and measures staleness
    against; other jobs keep the service's registry model."""
    t = await trainer.start()
    own = registry.for_model("run-a-student")
    spec = sft_spec(total_steps=1, weight_model="run-a-student")
    job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
    assert job.spec.weight_model == "run-a-student"
    await submit(t.stub, job.id, groups(1, 4))
    stepped = await t.stub.Step(api.StepRequest(job_id=job.id, steps=1, publish=True))
    found = await own.get(stepped.weight_version)
    assert found is not None and found.metadata["job"] == job.id
    assert await registry.latest() is None  # the service's model got nothing

    # Staleness is measured against the job's own model: v1 is one behind there.
    await own.publish("v1", "file:///models/v1")
    await own.publish("v2", "file:///models/v2")
    rl = api.TrainingJobSpec(
        mode=api.TRAINING_MODE_RL, model="builtin:tiny", max_staleness=0,
        weight_model="run-a-student",
    )  # fmt: skip
    rl_job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=rl))).job
    build = TrajectoryBuilder()
    members = []
    for name, reward in (("a", 1.0), ("b", 0.0)):
        member = build([build.Turn(inputs=[1, 11, 2], outputs=[14, 3])], reward=reward)
        member.id = name
        member.turns[0].weight_version = "v1"
        members.append(member)
    code, message = await failure(
        submit(t.stub, rl_job.id, [trajectory_pb2.TrajectoryGroup(id="g", trajectories=members)])
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "1 versions behind" in message

    code, message = await failure(
        t.stub.CreateTrainingJob(
            api.CreateTrainingJobRequest(spec=sft_spec(weight_model="no spaces/here"))
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "spec.weight_model" in message
