"""The trainer names artifacts by URL, over real gRPC with a real etcd: a job's model and dataset
must lie in the artifact store (a tenant cannot make it read the host's files), checkpoints
and published weights are URLs in the store, a job resumes from the store alone, and the
rollout's local engine loads what the trainer published."""

from __future__ import annotations

import contextlib
import json
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import grpc
import pytest

from orchard.core.artifacts import ArtifactsConfig, ArtifactStore
from orchard.core.config import ServerConfig
from orchard.core.errors import error_info
from orchard.core.etcd import EtcdStore
from orchard.lm.model_folder import save_model_folder
from orchard.lm.weights import WeightRegistry
from orchard.rollout.engines.base import SamplingParams
from orchard.rollout.engines.local import LocalEngine, LocalEngineConfig
from orchard.trainer.config import EtcdConfig, TrainerConfig, WeightsConfig
from orchard.trainer.datasets import write_trajectories
from orchard.trainer.policy import load_policy
from orchard.trainer.v1 import trainer_service_pb2 as api

from .conftest import synthetic_trajectories
from .test_service import Trainer, groups, local, sft_spec, submit

State = api.TrainingJobState


@pytest.fixture
def namespace() -> str:
    return f"test/{uuid.uuid4().hex}/"


@pytest.fixture
def configure(etcd, namespace: str, tmp_path: Path) -> Callable[..., TrainerConfig]:
    def make(root: str | None = None, scratch: str = "scratch", **_: Any) -> TrainerConfig:
        return TrainerConfig(
            server=ServerConfig(listen=["127.0.0.1:0"], metrics_address="127.0.0.1:0"),
            etcd=EtcdConfig(
                endpoints=[etcd.endpoint], prefix=namespace + "trainer/", weights_prefix=namespace
            ),
            artifacts=ArtifactsConfig(root=root or (tmp_path / "store").as_uri()),
            weights=WeightsConfig(scratch_dir=str(tmp_path / scratch)),
        )

    return make


@pytest.fixture
async def registry(etcd, namespace: str) -> AsyncIterator[WeightRegistry]:
    async with EtcdStore([etcd.endpoint], namespace=namespace) as store:
        yield WeightRegistry(store, "policy")
        await store.delete_prefix("")


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    root.mkdir()
    return root


@pytest.fixture
def memory_bucket() -> Iterator[str]:
    bucket = f"trainer-{uuid.uuid4().hex[:8]}"
    yield f"memory://{bucket}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{bucket}"):
        fs.rm(f"/{bucket}", recursive=True)


@contextlib.asynccontextmanager
async def running(make: Callable[..., TrainerConfig]) -> AsyncIterator[Trainer]:
    trainer = Trainer(make)
    try:
        yield trainer
    finally:
        await trainer.close()


async def refused(stub: Any, spec: api.TrainingJobSpec) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))
    info = error_info(caught.value)
    assert info is not None
    return caught.value.code(), info.reason, caught.value.details() or ""


def put_model_and_dataset(store: ArtifactStore, tmp_path: Path) -> tuple[str, str]:
    """The built-in tiny model as a folder and 16 trajectories as JSONL, put in `store`."""
    policy = load_policy("builtin:tiny")
    assert policy.tokenizer is not None
    folder = save_model_folder(tmp_path / "model-src", policy.model, policy.tokenizer)
    model = store.put_dir(folder, store.url("models", "tiny"))
    lines = tmp_path / "train.jsonl"
    write_trajectories(lines, synthetic_trajectories(16, 3))
    dataset = store.write_bytes(store.url("datasets", "train.jsonl"), lines.read_bytes())
    shutil.rmtree(folder)
    lines.unlink()
    return model, dataset


async def test_a_tenant_cannot_make_the_trainer_read_host_files(configure, store_dir: Path):
    async with running(configure) as trainer:
        t = await trainer.start()
        (store_dir / "innocent.jsonl").symlink_to("/etc/passwd")
        (store_dir / "model").symlink_to("/etc")
        # a model folder in the store holding a link to a host file: the trainer would read
        # it and save it into a checkpoint the tenant can read back
        leaky = store_dir / "leaky"
        leaky.mkdir()
        (leaky / "config.json").write_text("{}")
        (leaky / "tokenizer.json").write_text("{}")
        (leaky / "special_tokens_map.json").symlink_to("/etc/shadow")
        denied = (grpc.StatusCode.PERMISSION_DENIED, "ARTIFACT_ACCESS_DENIED")
        for spec, field in [
            (sft_spec(dataset="file:///etc/passwd"), "spec.dataset"),
            (sft_spec(model="file:///etc"), "spec.model"),
            (sft_spec(dataset=f"{store_dir.as_uri()}/innocent.jsonl"), "resolves to"),
            (sft_spec(model=f"{store_dir.as_uri()}/model"), "resolves to"),
            (
                sft_spec(model=f"{store_dir.as_uri()}/leaky"),
                "special_tokens_map.json -> file:///etc",
            ),
            (sft_spec(dataset="http://169.254.169.254/latest/meta-data"), "spec.dataset"),
        ]:
            code, reason, message = await refused(t.stub, spec)
            assert (code, reason) == denied, message
            assert field in message and "artifacts.allowed" in message
        listed = await t.stub.ListTrainingJobs(api.ListTrainingJobsRequest())
        assert list(listed.jobs) == []  # refused before any job existed


async def test_bad_and_missing_urls_get_their_statuses(configure, store_dir: Path):
    (store_dir / "empty-model").mkdir()
    async with running(configure) as trainer:
        t = await trainer.start()
        invalid = (grpc.StatusCode.INVALID_ARGUMENT, "ARTIFACT_URL_INVALID")
        missing = (grpc.StatusCode.NOT_FOUND, "ARTIFACT_NOT_FOUND")
        cases = [
            (sft_spec(dataset="/data/train.jsonl"), invalid, "file:///data/train.jsonl"),
            (sft_spec(model="models/tiny"), invalid, "file:///ABSOLUTE/PATH"),
            (sft_spec(dataset=f"{store_dir.as_uri()}/../x.jsonl"), invalid, "'..'"),
            (sft_spec(dataset=f"{store_dir.as_uri()}/none.jsonl"), missing, "nothing is there"),
            (sft_spec(model=f"{store_dir.as_uri()}/none"), missing, "spec.model"),
            (sft_spec(model=f"{store_dir.as_uri()}/empty-model"), missing, "config.json"),
        ]
        for spec, expected, needle in cases:
            code, reason, message = await refused(t.stub, spec)
            assert (code, reason) == expected, message
            assert needle in message


async def test_a_job_on_urls_trains_publishes_a_url_and_the_engine_loads_it(
    configure, registry, store_dir: Path, tmp_path: Path
):
    store = ArtifactStore(store_dir.as_uri())
    model, dataset = put_model_and_dataset(store, tmp_path)
    async with running(configure) as trainer:
        t = await trainer.start()
        spec = sft_spec(model=model, dataset=dataset, total_steps=2)
        job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
        assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
        assert (job.spec.model, job.spec.dataset) == (model, dataset)
        last = await t.stub.Step(api.StepRequest(job_id=job.id, steps=2, publish=True))
        latest = await registry.latest()
        assert latest is not None and latest.version == last.weight_version
        checkpoint_url = f"{store.url('checkpoints', job.id, last.weight_version)}"
        assert latest.location == f"{checkpoint_url}/model"
        assert latest.metadata["checkpoint"] == checkpoint_url
        listed = await t.stub.ListCheckpoints(api.ListCheckpointsRequest(job_id=job.id))
        assert [c.uri for c in listed.checkpoints] == [checkpoint_url]
        assert (local(checkpoint_url) / "deepspeed").is_dir()
        # nothing stays in the scratch folder but the run log
        scratch = tmp_path / "scratch" / job.id
        assert sorted(p.name for p in scratch.iterdir()) == ["run.jsonl"]

    async with LocalEngine(LocalEngineConfig(), registry=registry) as engine:
        assert engine.weight_version == last.weight_version
        sampled = await engine.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
        assert sampled.weight_version == last.weight_version


async def test_a_job_resumes_from_the_store_alone(configure, memory_bucket: str, tmp_path: Path):
    # an object store stands in for the shared volume: the second process has a fresh scratch
    # folder, so the checkpoint can only come back from the store
    store = ArtifactStore(memory_bucket)
    async with running(lambda **jobs: configure(memory_bucket, "scratch-1")) as first:
        t = await first.start()
        job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=sft_spec()))).job
        batch = groups(2, 4)
        await submit(t.stub, job.id, batch)
        await t.stub.Step(api.StepRequest(job_id=job.id, steps=2))
        saved = (await t.stub.SaveCheckpoint(api.SaveCheckpointRequest(job_id=job.id))).checkpoint
        assert saved.uri == store.url("checkpoints", job.id, f"{job.id}-step-000002")
        before = await t.stub.Step(api.StepRequest(job_id=job.id, steps=2))
    shutil.rmtree(tmp_path / "scratch-1")

    async with running(lambda **jobs: configure(memory_bucket, "scratch-2")) as second:
        t = await second.start()
        resumed = (await t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=job.id))).job
        assert resumed.state == State.TRAINING_JOB_STATE_RUNNING, resumed.error
        await submit(t.stub, job.id, batch)
        after = await t.stub.Step(api.StepRequest(job_id=job.id, steps=2))
        assert [s.step for s in after.steps] == [3, 4]
        for a, b in zip(before.steps, after.steps, strict=True):
            assert b.loss == pytest.approx(a.loss, rel=1e-5)
        published = await t.stub.PublishCheckpoint(
            api.PublishCheckpointRequest(job_id=job.id, step=2)
        )
        assert published.checkpoint.weight_version == f"{job.id}-step-000002"
        await t.stub.SaveCheckpoint(api.SaveCheckpointRequest(job_id=job.id))
    # the run log lives on in the store: the first process's steps up to its checkpoint, then
    # the second's (the steps after it went with the first process's scratch folder)
    logged = store.read_bytes(store.url("checkpoints", job.id, "run.jsonl")).decode()
    assert [json.loads(line)["step"] for line in logged.splitlines()] == [1, 2, 3, 4]
