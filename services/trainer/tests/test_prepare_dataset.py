"""TrainerService.PrepareDataset over real gRPC with a real etcd: teacher conversations as the
rollout service streams them become the student's tokens, curation runs in the trainer, the
dataset lands in the artifact store, and bad input fails the call with a status a person can
act on."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from orchard.core.artifacts import ArtifactsConfig, ArtifactStore
from orchard.core.config import ServerConfig
from orchard.core.errors import error_info
from orchard.lm.chat import ChatRenderer
from orchard.lm.model_folder import save_model_folder
from orchard.lm.tokenizer import build_tokenizer
from orchard.trainer.config import EtcdConfig, JobsConfig, TrainerConfig, WeightsConfig
from orchard.trainer.datasets import parse_trajectories
from orchard.trainer.masks import SampleConfig, build_sft_samples
from orchard.trainer.policy import load_policy
from orchard.trainer.teacher import teacher_trajectory
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.types.v1 import reward_pb2, trajectory_pb2

from .test_service import Running, Trainer
from .test_teacher import TOOLS, conversation, teacher_rollout

HARNESS_TOOLS = [api.HarnessTools(harness="builtin:swe", tools_json=json.dumps(TOOLS))]
CURATION = api.CurationSettings(
    max_tokens=4096, drop_unparsable=True, drop_unknown_tools=True, shortest_success_per_task=True
)


@pytest.fixture
def configure(etcd, tmp_path: Path) -> Callable[..., TrainerConfig]:
    namespace = f"test/{tmp_path.name}/"

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


@pytest.fixture
async def trainer(configure) -> AsyncIterator[Running]:
    running = Trainer(configure)
    try:
        yield await running.start()
    finally:
        await running.close()


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore((tmp_path / "store").as_uri())


def put_rows(store: ArtifactStore, name: str, rows: list[trajectory_pb2.Trajectory]) -> str:
    text = "".join(json_format.MessageToJson(r, indent=None) + "\n" for r in rows)
    return store.write_bytes(store.url("in", name), text.encode())


def failed_rollout(**fields: Any) -> trajectory_pb2.Trajectory:
    """A teacher's failed rollout with credit: its second turn is a rise segment."""
    row = teacher_rollout(
        id="r3/0",
        rollout_id="r3",
        task_id="t2",
        reward=reward_pb2.Reward(status=reward_pb2.REWARD_STATUS_SCORED, value=-1.0),
        **fields,
    )
    row.credit.rise_segments.add(start=1, end=1)
    return row


def student_rollout() -> trajectory_pb2.Trajectory:
    """The student's own rollout: turns in its tokens, sampled with logprobs."""
    row = trajectory_pb2.Trajectory(id="s1/0", rollout_id="s1", task_id="t3", harness="builtin:swe")
    row.reward.status = reward_pb2.REWARD_STATUS_SCORED
    row.reward.value = 1.0
    row.turns.add(
        index=0,
        kind=trajectory_pb2.TURN_KIND_POLICY,
        input_token_ids=[1, 2, 3],
        output_token_ids=[4, 5],
        output_logprobs=[-0.1, -0.2],
    )
    return row


def rows_of_a_collect_stage() -> list[trajectory_pb2.Trajectory]:
    longer = conversation("cat src/a/rules.py src/a/__init__.py src/a/other.py")
    return [
        teacher_rollout(),  # resolved
        teacher_rollout(id="r2/0", rollout_id="r2", conversation_json=json.dumps(longer)),
        failed_rollout(),
        teacher_rollout(id="r4/0", rollout_id="r4", conversation_json="[{"),
        teacher_rollout(id="r5/0", rollout_id="r5", harness="builtin:browser"),
        student_rollout(),
    ]


async def prepare(
    trainer: Running, **fields: Any
) -> tuple[list[api.PrepareDatasetProgress], api.PrepareDatasetResult]:
    progress: list[api.PrepareDatasetProgress] = []
    result: api.PrepareDatasetResult | None = None
    async for message in trainer.stub.PrepareDataset(api.PrepareDatasetRequest(**fields)):
        assert result is None, "a message came after the result"
        if message.HasField("progress"):
            progress.append(message.progress)
        else:
            result = message.result
    assert result is not None
    return progress, result


async def refused(trainer: Running, **fields: Any) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await prepare(trainer, **fields)
    info = error_info(caught.value)
    assert info is not None
    return caught.value.code(), info.reason, caught.value.details() or ""


def read_dataset(store: ArtifactStore, url: str) -> list[trajectory_pb2.Trajectory]:
    with store.open_read(url, text=True) as lines:
        return list(parse_trajectories(lines, url))


async def test_teacher_rollouts_become_a_curated_dataset_in_the_students_tokens(
    trainer: Running, store: ArtifactStore
) -> None:
    rows = rows_of_a_collect_stage()
    source = put_rows(store, "collect.jsonl", rows)
    output = store.url("datasets", "sft.jsonl")
    progress, result = await prepare(
        trainer,
        model="builtin:tiny",
        trajectories=source,
        tools=HARNESS_TOOLS,
        curation=CURATION,
        output=output,
        source_model="scripted-teacher",
        examples_per_reason=2,
    )
    assert (result.rows_in, result.rows_rendered, result.rows_passed) == (6, 3, 1)
    assert result.rows_unrendered == 2
    assert dict(result.unrendered_by_reason) == {"bad_conversation": 1, "unknown_harness": 1}
    assert {(u.trajectory_id, u.line, u.reason) for u in result.unrendered} == {
        ("r4/0", 4, "bad_conversation"),
        ("r5/0", 5, "unknown_harness"),
    }
    assert "builtin:browser" in next(u.detail for u in result.unrendered if u.line == 5)
    # Progress named every row before the result.
    assert progress and progress[-1].rows_done == progress[-1].rows_total == 6

    # Curation ran in the trainer: of task t1's two successes the shorter stays.
    steps = {r.step.split("(")[0]: r for r in result.curation}
    assert list(steps) == [
        "token_limit",
        "parsable_actions",
        "known_tools",
        "shortest_successful",
    ]
    shortest = steps["shortest_successful"]
    assert (shortest.rows_in, shortest.kept, shortest.dropped) == (4, 3, 1)
    assert dict(shortest.dropped_by_reason) == {"longer_success": 1}
    assert [e.trajectory_id for e in shortest.examples] == ["r2/0"]
    assert "shortest_successful" in result.curation_summary and "r2/0" in result.curation_summary

    # The dataset is in the store: exactly the kept rows, in the student's tokens.
    assert result.dataset == output and result.rows_kept == 3
    written = read_dataset(store, output)
    assert [r.id for r in written] == ["r1/0", "r3/0", "s1/0"]
    renderer = ChatRenderer(build_tokenizer())
    expected = teacher_trajectory(rows[0], renderer, TOOLS, teacher_model="scripted-teacher")
    assert written[0] == expected
    assert written[0].turns[0].weight_version == "teacher:scripted-teacher"
    assert all(len(t.output_loss_mask) == len(t.output_token_ids) for t in written[0].turns)
    assert [(s.start, s.end) for s in written[1].credit.rise_segments] == [(1, 1)]
    assert written[2] == rows[5]  # the student's own tokens stay as they were
    # The count is what an SFT job builds from the file.
    built = build_sft_samples(written, SampleConfig())
    assert result.sft_samples == len(built.samples) == 3


async def test_one_success_threshold_decides_curation_and_the_samples_counted(
    trainer: Running, store: ArtifactStore
) -> None:
    """A row at the threshold is a success (it trains whole); one just below it is a failure
    without credit (no sample). Unset, the threshold is 0.5; the deprecated curation field is
    taken when it is the only one given."""
    at = student_rollout()
    at.reward.value = 0.75
    below = student_rollout()
    below.id, below.rollout_id, below.reward.value = "s2/0", "s2", 0.7499
    rows = put_rows(store, "edge.jsonl", [at, below])
    base = {"model": "builtin:tiny", "trajectories": rows, "tools": HARNESS_TOOLS}
    one_each = api.CurationSettings(shortest_success_per_task=True, per_harness=True)

    def output() -> str:
        return store.url("datasets", f"edge-{uuid.uuid4().hex}.jsonl")

    _, result = await prepare(trainer, **base, output=output(), success_threshold=0.75)
    assert (result.sft_samples, dict(result.sft_skipped)) == (1, {"no_loss_tokens": 1})
    _, result = await prepare(
        trainer, **base, output=output(), success_threshold=0.75, curation=one_each
    )
    # Only `at` is a success, so curation has no longer success to drop: both rows stay.
    assert (result.rows_kept, result.sft_samples) == (2, 1)
    legacy = api.CurationSettings(shortest_success_per_task=True, success_threshold=0.75)
    _, result = await prepare(trainer, **base, output=output(), curation=legacy)
    assert (result.rows_kept, result.sft_samples) == (2, 1)
    # Unset: 0.5, so both rows succeed; curation keeps the shorter success of the task.
    _, result = await prepare(trainer, **base, output=output())
    assert result.sft_samples == 2
    _, result = await prepare(trainer, **base, output=output(), curation=one_each)
    assert (result.rows_kept, result.sft_samples) == (1, 1)


async def test_a_model_folder_by_url_renders_with_its_own_tokenizer(
    trainer: Running, store: ArtifactStore, tmp_path: Path
) -> None:
    policy = load_policy("builtin:tiny")
    assert policy.tokenizer is not None
    folder = save_model_folder(tmp_path / "model-src", policy.model, policy.tokenizer)
    model = store.put_dir(folder, store.url("models", "tiny"))
    shutil.rmtree(folder)
    source = put_rows(store, "one.jsonl", [teacher_rollout()])
    _, by_url = await prepare(
        trainer,
        model=model,
        trajectories=source,
        tools=HARNESS_TOOLS,
        output=store.url("datasets", "by-url.jsonl"),
    )
    _, builtin = await prepare(
        trainer,
        model="builtin:tiny",
        trajectories=source,
        tools=HARNESS_TOOLS,
        output=store.url("datasets", "builtin.jsonl"),
    )
    assert not by_url.curation and by_url.rows_kept == 1  # no curation asked for
    (row,) = read_dataset(store, by_url.dataset)
    assert row == read_dataset(store, builtin.dataset)[0]
    assert row.turns[0].weight_version == "teacher:unknown"


async def test_rows_in_another_models_tokens_and_bad_credit_are_left_out_by_name(
    trainer: Running, store: ArtifactStore
) -> None:
    foreign = student_rollout()
    foreign.turns[0].output_token_ids[:] = [4, 10**6]
    foreign.turns[0].output_logprobs[:] = [-0.1, -0.2]
    bad_span = failed_rollout()
    bad_span.credit.rise_segments[0].end = 9
    source = put_rows(store, "mixed.jsonl", [foreign, bad_span, teacher_rollout()])
    _, result = await prepare(
        trainer,
        model="builtin:tiny",
        trajectories=source,
        tools=HARNESS_TOOLS,
        output=store.url("datasets", "mixed.jsonl"),
    )
    reasons = {u.trajectory_id: u.reason for u in result.unrendered}
    assert reasons == {"s1/0": "token_out_of_vocabulary", "r3/0": "malformed_trajectory"}
    assert result.rows_kept == 1 and result.sft_samples == 1


async def test_bad_urls_and_unreadable_rows_fail_the_call_and_write_nothing(
    trainer: Running, store: ArtifactStore, tmp_path: Path
) -> None:
    good = put_rows(store, "good.jsonl", [teacher_rollout()])
    output = store.url("datasets", "never.jsonl")
    base = {"model": "builtin:tiny", "trajectories": good, "tools": HARNESS_TOOLS}

    def ask(**fields: Any) -> Any:
        return refused(trainer, **({**base, "output": output} | fields))

    code, reason, message = await ask(trajectories="/srv/collect.jsonl")
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "ARTIFACT_URL_INVALID")
    code, reason, _ = await ask(trajectories="file:///etc/passwd")
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ARTIFACT_ACCESS_DENIED")
    code, reason, message = await ask(trajectories=store.url("in", "missing.jsonl"))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "ARTIFACT_NOT_FOUND")
    assert "missing.jsonl" in message
    code, reason, _ = await ask(output="file:///etc/orchard-sft.jsonl")
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ARTIFACT_ACCESS_DENIED")
    code, reason, _ = await ask(model=store.url("models", "nothing"))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "ARTIFACT_NOT_FOUND")

    broken = store.write_bytes(
        store.url("in", "broken.jsonl"),
        (json_format.MessageToJson(teacher_rollout(), indent=None) + "\n{not json\n").encode(),
    )
    code, reason, message = await ask(trajectories=broken)
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    assert "broken.jsonl:2: not a trajectory" in message

    code, _, message = await ask(model="builtin:huge")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "builtin:tiny" in message
    code, _, message = await ask(tools=[api.HarnessTools(harness="builtin:swe", tools_json="{")])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "builtin:swe" in message
    code, _, message = await ask(tools=[], curation=CURATION)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "request.tools" in message
    code, _, message = await ask(output="")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "output is required" in message
    code, _, message = await ask(success_threshold=1.5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "success_threshold must be a number in [0, 1], got 1.5" in message
    mismatch = api.CurationSettings(shortest_success_per_task=True, success_threshold=0.7)
    code, _, message = await ask(success_threshold=0.6, curation=mismatch)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "differ" in message
    assert not store.exists(output)

    taken = store.write_bytes(store.url("datasets", "taken.jsonl"), b"")
    code, reason, message = await ask(output=taken)
    assert (code, reason) == (grpc.StatusCode.ALREADY_EXISTS, "ALREADY_EXISTS")
    assert store.read_bytes(taken) == b""  # artifacts never change


async def test_a_large_input_streams_progress_and_a_caller_that_leaves_writes_nothing(
    configure, store: ArtifactStore
) -> None:
    many = [teacher_rollout(id=f"r{k}/0", rollout_id=f"r{k}", task_id=f"t{k}") for k in range(400)]
    source = put_rows(store, "many.jsonl", many)
    running = Trainer(configure)
    try:
        trainer = await running.start(max_preparing=1)
        # A caller that goes away after the first progress message: the work stops, nothing
        # is written, and the slot is free again.
        left = store.url("datasets", "left.jsonl")
        call = trainer.stub.PrepareDataset(
            api.PrepareDatasetRequest(
                model="builtin:tiny", trajectories=source, tools=HARNESS_TOOLS, output=left
            )
        )
        first = await call.read()
        assert first.HasField("progress") and first.progress.rows_total == 400
        call.cancel()
        for _ in range(100):  # the thread stops at its next row
            progress, result = await prepare_when_free(trainer, source, store)
            if result is not None:
                break
        assert result is not None and not store.exists(left)
        assert result.rows_rendered == 400 and result.sft_samples == 400
        assert len(progress) >= 2 and progress[-1].rows_done == 400
    finally:
        await running.close()


async def prepare_when_free(
    trainer: Running, source: str, store: ArtifactStore
) -> tuple[list[api.PrepareDatasetProgress], api.PrepareDatasetResult | None]:
    try:
        return await prepare(
            trainer,
            model="builtin:tiny",
            trajectories=source,
            tools=HARNESS_TOOLS,
            output=store.url("datasets", "all.jsonl"),
        )
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
        await asyncio.sleep(0.05)
        return [], None
