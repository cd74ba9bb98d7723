"""Ranks on standing workers (`workers.kind: pods`), over real gRPC with a real etcd.

Two real ``orchard-trainer worker`` processes on loopback ports stand in for the worker Pods
(no Kubernetes here; the Pods run the same command). A 2-rank SFT job on them takes the same
steps as on local rank processes; a wrong key is refused; a killed rank fails its job with a
message naming it and the worker serves the next job; a missing worker fails the start and
names it; no rank is left behind (checked by pid).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

import pytest

from orchard.core.artifacts import ArtifactsConfig
from orchard.core.config import ServerConfig
from orchard.trainer.config import (
    EtcdConfig,
    PodWorkersConfig,
    TrainerConfig,
    WeightsConfig,
    WorkersConfig,
)
from orchard.trainer.distributed import free_port
from orchard.trainer.v1 import trainer_service_pb2 as api

from .test_service import Running, Trainer, groups, sft_spec, submit

State = api.TrainingJobState
KEY = b"a-shared-key-of-the-tests-0123456789"


@dataclass
class Worker:
    process: subprocess.Popen[bytes]
    endpoint: str
    log: Path

    def children(self) -> list[int]:
        """The worker's child processes (its rank, while one runs)."""
        pid = self.process.pid
        path = Path(f"/proc/{pid}/task/{pid}/children")
        return [int(p) for p in path.read_text().split()] if path.exists() else []


def tuple_of(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def wait_until(condition: Callable[[], bool], seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def start_worker(tmp_path: Path, index: int, key_file: Path) -> Worker:
    port = free_port()
    log = tmp_path / f"worker-{index}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orchard.trainer.cli",
                "worker",
                "--listen",
                f"127.0.0.1:{port}",
                "--key-file",
                str(key_file),
                "--stop-timeout",
                "5",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Worker(process, f"127.0.0.1:{port}", log)


def probe(worker: Worker) -> int:
    """Wait until `worker` takes a job, and leave it at once; the pid of the rank it started,
    which ends as soon as the worker sees the connection closed."""
    process, log = worker.process, worker.log
    port = tuple_of(worker.endpoint)[1]
    started: list[int] = []

    def listening() -> bool:
        assert process.poll() is None, log.read_text()
        try:
            with Client(("127.0.0.1", port), authkey=KEY) as conn:
                status, hello = conn.recv()
        except ConnectionRefusedError:
            return False
        assert status == "ready", hello
        started.append(hello["pid"])
        return True

    assert wait_until(listening, 30.0), log.read_text()
    return started[0]


def ended(worker: Worker, pid: int) -> bool:
    """Whether `worker` has logged the end of its rank `pid` (its last step for that job)."""
    return f'"rank_pid": {pid}, "status"' in worker.log.read_text()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[Worker]]:
    key_file = tmp_path / "worker-key"
    key_file.write_bytes(KEY + b"\n")
    started: list[Worker] = []
    try:
        for index in range(2):
            started.append(start_worker(tmp_path, index, key_file))
        probes = [probe(worker) for worker in started]
        # A worker is free again once it has logged the end of the probe's rank.
        for worker, pid in zip(started, probes, strict=True):
            assert wait_until(lambda: ended(worker, pid), 30.0), worker.log.read_text()  # noqa: B023
        yield started
    finally:
        for worker in started:
            worker.process.send_signal(signal.SIGTERM)
        for worker in started:
            assert worker.process.wait(timeout=30) == 0, worker.log.read_text()


@pytest.fixture
def configure(etcd, tmp_path: Path) -> Callable[..., TrainerConfig]:
    namespace = f"test/{uuid.uuid4().hex}/"

    def make(
        kind: str = "pods", endpoints: list[str] | None = None, key: bytes = KEY
    ) -> TrainerConfig:
        key_file = tmp_path / f"controller-key-{uuid.uuid4().hex[:6]}"
        key_file.write_bytes(key)
        return TrainerConfig(
            server=ServerConfig(listen=["127.0.0.1:0"], metrics_address="127.0.0.1:0"),
            etcd=EtcdConfig(
                endpoints=[etcd.endpoint], prefix=namespace + "trainer/", weights_prefix=namespace
            ),
            artifacts=ArtifactsConfig(root=(tmp_path / "store").as_uri()),
            weights=WeightsConfig(scratch_dir=str(tmp_path / f"scratch-{kind}")),
            workers=WorkersConfig(
                kind=kind,
                ranks=2,
                threads_per_rank=1,
                stop_timeout_s=5.0,
                pods=PodWorkersConfig(
                    endpoints=endpoints or [],
                    key_file=str(key_file),
                    rendezvous_port=0,
                    connect_timeout_s=5.0,
                ),
            ),
        )

    return make


@pytest.fixture
async def trainer(configure) -> AsyncIterator[Trainer]:
    running = Trainer(configure)
    try:
        yield running
    finally:
        await running.close()


def pids_of(t: Running, job_id: str) -> list[int]:
    assert t.app.jobs is not None
    return t.app.jobs.rank_pids(job_id)


async def create(t: Running, **fields: Any) -> api.TrainingJob:
    request = api.CreateTrainingJobRequest(spec=sft_spec(**fields))
    return (await t.stub.CreateTrainingJob(request)).job


async def wait_state(t: Running, job_id: str, state: int, seconds: float = 30.0) -> api.TrainingJob:
    deadline = time.monotonic() + seconds
    while True:
        job = (await t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=job_id))).job
        if job.state == state or time.monotonic() > deadline:
            return job
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_ranks_on_workers_train_like_local_ranks_and_a_killed_one_fails_its_job(
    workers, trainer
):
    endpoints = [w.endpoint for w in workers]
    data = groups(2, 8)
    common = dict(zero_stage=2, ranks=2, total_steps=8, warmup_steps=1)

    local = await trainer.start(kind="subprocess")
    job = await create(local, **common)
    assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
    await submit(local.stub, job.id, data)
    expected = (await local.stub.Step(api.StepRequest(job_id=job.id, steps=3))).steps
    await local.stub.CancelTrainingJob(api.CancelTrainingJobRequest(job_id=job.id))
    await trainer.stop_last()

    t = await trainer.start(kind="pods", endpoints=endpoints)
    job = await create(t, **common)
    assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
    pids = pids_of(t, job.id)
    assert pids == [workers[0].children()[0], workers[1].children()[0]]
    await submit(t.stub, job.id, data)
    steps = (await t.stub.Step(api.StepRequest(job_id=job.id, steps=3))).steps
    assert [s.step for s in steps] == [1, 2, 3]
    for a, b in zip(expected, steps, strict=True):
        assert b.loss == pytest.approx(a.loss, rel=1e-6)
        assert b.loss_tokens == a.loss_tokens
    saved = (await t.stub.SaveCheckpoint(api.SaveCheckpointRequest(job_id=job.id))).checkpoint
    assert saved.step == 3

    # A second controller is turned away while a job runs on the worker.
    with Client(tuple_of(workers[0].endpoint), authkey=KEY) as other:
        status, message = other.recv()
    assert status == "busy" and "one job at a time" in message

    # A rank killed while its job is idle: the job fails with a message that names it.
    os.kill(pids[1], signal.SIGKILL)
    job = await wait_state(t, job.id, State.TRAINING_JOB_STATE_FAILED)
    assert job.state == State.TRAINING_JOB_STATE_FAILED, job.error
    assert f"rank 1 of 2 (pod {endpoints[1]}, pid {pids[1]}) was killed by SIGKILL" in job.error
    assert wait_until(lambda: not any(alive(p) for p in pids), 15.0)
    assert wait_until(lambda: all(ended(w, p) for w, p in zip(workers, pids, strict=True)), 15.0)

    # The workers serve the next job, with fresh rank processes.
    job = await create(t, **common)
    assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
    fresh = pids_of(t, job.id)
    assert set(fresh).isdisjoint(pids)
    await submit(t.stub, job.id, data)
    assert len((await t.stub.Step(api.StepRequest(job_id=job.id, steps=1))).steps) == 1
    cancelled = (await t.stub.CancelTrainingJob(api.CancelTrainingJobRequest(job_id=job.id))).job
    assert cancelled.state == State.TRAINING_JOB_STATE_CANCELLED
    assert wait_until(lambda: not any(alive(p) for p in fresh), 15.0)
    assert wait_until(lambda: not workers[0].children() and not workers[1].children(), 15.0)


async def test_a_wrong_key_or_a_missing_worker_fails_the_start_and_names_it(workers, trainer):
    # Straight to a worker: the key check fails before anything is unpickled.
    with pytest.raises(AuthenticationError):
        Client(tuple_of(workers[0].endpoint), authkey=b"not-the-key-of-these-workers")
    assert wait_until(lambda: "refused a controller with a wrong key" in workers[0].log.read_text())

    # Through the service: a job whose workers refuse the key fails, naming each one.
    endpoints = [w.endpoint for w in workers]
    t = await trainer.start(kind="pods", endpoints=endpoints, key=b"not-the-key-of-these-workers")
    job = await create(t, ranks=2)
    assert job.state == State.TRAINING_JOB_STATE_FAILED
    for endpoint in endpoints:
        assert f"{endpoint} (refused the key: workers.pods.key_file" in job.error
    await trainer.stop_last()

    # One worker does not answer: the job fails at start, and the worker that took it is free.
    missing = f"127.0.0.1:{free_port()}"
    t = await trainer.start(kind="pods", endpoints=[endpoints[0], missing])
    job = await create(t, ranks=2)
    assert job.state == State.TRAINING_JOB_STATE_FAILED
    assert "the job needs 2 workers and only 1 of workers.pods.endpoints took it" in job.error
    assert f"{missing} (did not answer: Connection refused)" in job.error
    # The rank the first worker started for it ends as soon as the job's start fails.
    assert wait_until(lambda: not workers[0].children(), 15.0)

    # More ranks than workers: said before any worker is asked.
    job = await create(t, ranks=3)
    assert job.state == State.TRAINING_JOB_STATE_FAILED
    assert "the job has 3 ranks but workers.pods.endpoints names 2 worker(s)" in job.error


def test_pods_need_workers_a_key_and_a_shared_scratch_folder() -> None:
    base: dict[str, Any] = {"etcd": {"endpoints": ["http://127.0.0.1:2379"]}}  # never dialled
    with pytest.raises(ValueError, match=r"workers.pods.endpoints\) and the file"):
        TrainerConfig.model_validate({**base, "workers": {"kind": "pods"}})
    pods = {"kind": "pods", "pods": {"endpoints": ["w-0.w:7400"], "key_file": "k"}}
    with pytest.raises(ValueError, match="must be an absolute path on a volume"):
        TrainerConfig.model_validate({**base, "workers": pods})
    with pytest.raises(ValueError, match=r"'w-0\.w' is not HOST:PORT"):
        TrainerConfig.model_validate(
            {**base, "workers": {"kind": "pods", "pods": {"endpoints": ["w-0.w"], "key_file": "k"}}}
        )
    config = TrainerConfig.model_validate(
        {**base, "workers": pods, "weights": {"scratch_dir": "/srv/artifacts/scratch"}}
    )
    assert config.workers.pods.rendezvous_port == 29500


def test_a_worker_without_a_usable_key_says_how_to_give_one(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ORCHARD_TRAINER_WORKER_KEY_FILE"}
    command = [sys.executable, "-m", "orchard.trainer.cli", "worker", "--listen", "127.0.0.1:0"]
    missing = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, timeout=60
    )
    assert missing.returncode == 2
    assert "--key-file FILE or $ORCHARD_TRAINER_WORKER_KEY_FILE" in missing.stderr
    short = tmp_path / "short-key"
    short.write_bytes(b"tiny\n")
    refused = subprocess.run(
        [*command, "--key-file", str(short)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "has 4 bytes; it needs at least 16" in refused.stderr
