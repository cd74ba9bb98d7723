"""Vision-language students (`orchard.trainer.vision`): GUI conversations with screenshots
render with the student's processor, the screenshots travel with the rows into SFT as pixel
values, the vision encoder stays as it was while the projector and the language model learn, and
a text student refuses screenshots by name. The student is a tiny LLaVA built in code."""

from __future__ import annotations

import base64
import io
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from google.protobuf import json_format
from PIL import Image, ImageDraw

from orchard.core.artifacts import ArtifactStore
from orchard.lm.models import tiny_vision_language_model, tiny_vision_processor
from orchard.trainer.datasets import parse_trajectories, write_trajectories
from orchard.trainer.distributed import free_port
from orchard.trainer.engine import EngineConfig
from orchard.trainer.masks import SampleConfig, Skip, SkipReason, TrajectoryError
from orchard.trainer.policy import load_policy
from orchard.trainer.prepare import DatasetPreparer
from orchard.trainer.rank import RankSetup, RankTrainer
from orchard.trainer.sft import SftRunConfig, run_offline_sft
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.trainer.vision import VisionSample, row_images
from orchard.types.v1 import reward_pb2, trajectory_pb2

IMAGE_TOKENS = 16  # 32-pixel images in 8-pixel patches
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in args}},
        },
    }
    for name, args in (
        ("click", [("x", "integer"), ("y", "integer")]),
        ("done", [("answer", "string")]),
    )
]
HARNESS_TOOLS = [api.HarnessTools(harness="builtin:browser", tools_json=json.dumps(TOOLS))]


def screenshot_url(color: str, size: tuple[int, int]) -> str:
    """A page-like PNG: white, with a coloured button."""
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).rectangle((4, 4, size[0] // 2, size[1] // 3), fill=color)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _call(index: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"c{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _screenshot(tool: str, url: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": f"Screenshot after {tool}:"},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }


def gui_conversation(k: int) -> list[dict[str, Any]]:
    """A `builtin:browser` episode as the rollout service records it: three actions, a
    screenshot after each of the first two (the first already a placeholder, as when only the
    last screenshots are kept)."""
    return [
        {"role": "system", "content": "You operate a web browser for a person."},
        {"role": "user", "content": f"Book the cheapest flight to city {k}."},
        {"role": "assistant", "content": "", "tool_calls": [_call(0, "click", {"x": 9, "y": k})]},
        {"role": "tool", "tool_call_id": "c0", "content": "clicked"},
        {"role": "user", "content": "Screenshot after click: [omitted: only the last 2 are kept]"},
        {"role": "assistant", "content": "", "tool_calls": [_call(1, "click", {"x": 3, "y": 7})]},
        {"role": "tool", "tool_call_id": "c1", "content": "clicked"},
        _screenshot("click", screenshot_url(("red", "green", "blue")[k % 3], (64, 40))),
        {"role": "assistant", "content": "Found it.",
         "tool_calls": [_call(2, "click", {"x": 30, "y": 5 + k})]},
        {"role": "tool", "tool_call_id": "c2", "content": "clicked"},
        _screenshot("click", screenshot_url("orange", (40, 72))),
        {"role": "assistant", "content": "", "tool_calls": [_call(3, "done", {"answer": f"{k}"})]},
        {"role": "tool", "tool_call_id": "c3", "content": "submitted"},
    ]  # fmt: skip


def gui_rollout(k: int) -> trajectory_pb2.Trajectory:
    return trajectory_pb2.Trajectory(
        id=f"g{k}/0",
        rollout_id=f"g{k}",
        task_id=f"gui-{k}",
        harness="builtin:browser",
        outcome=trajectory_pb2.TRAJECTORY_OUTCOME_COMPLETED,
        reward=reward_pb2.Reward(status=reward_pb2.REWARD_STATUS_SCORED, value=1.0),
        conversation_json=json.dumps(gui_conversation(k)),
    )


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaVA (CLIP tower, projector, Qwen2 language model) saved with its processor."""
    folder = tmp_path_factory.mktemp("vlm") / "model"
    processor = tiny_vision_processor()
    tiny_vision_language_model(processor).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore((tmp_path / "store").as_uri())


def prepare(
    store: ArtifactStore, tmp_path: Path, model: str, rows: list[trajectory_pb2.Trajectory]
) -> api.PrepareDatasetResult:
    """PrepareDataset's work, in this thread."""
    text = "".join(json_format.MessageToJson(r, indent=None) + "\n" for r in rows)
    source = store.write_bytes(store.url("in", "gui.jsonl"), text.encode())
    request = api.PrepareDatasetRequest(
        model=model,
        trajectories=source,
        tools=HARNESS_TOOLS,
        output=store.url("datasets", f"sft-{uuid.uuid4().hex}.jsonl"),
        source_model="gui-teacher",
    )
    preparer = DatasetPreparer(store, tmp_path / "cache")
    return preparer.prepare(request, lambda done, total: None, threading.Event())


def read_rows(store: ArtifactStore, url: str) -> list[trajectory_pb2.Trajectory]:
    with store.open_read(url, text=True) as lines:
        return list(parse_trajectories(lines, url))


@pytest.fixture
def prepared(
    vlm_folder: Path, store: ArtifactStore, tmp_path: Path
) -> Iterator[list[trajectory_pb2.Trajectory]]:
    """Three GUI episodes prepared for the tiny vision-language student."""
    model = store.put_dir(vlm_folder, store.url("models", "vlm"))
    result = prepare(store, tmp_path, model, [gui_rollout(k) for k in range(3)])
    assert (result.rows_rendered, result.rows_unrendered) == (3, 0), result.unrendered
    assert result.sft_samples == 3
    yield read_rows(store, result.dataset)


def test_screenshots_render_in_the_students_tokens_and_stay_with_the_row(
    prepared: list[trajectory_pb2.Trajectory], vlm_folder: Path
) -> None:
    row = prepared[0]
    assert [len(t.output_token_ids) > 0 for t in row.turns] == [True] * 4
    assert row.metadata["images"] == "2" and row.conversation_json
    policy = load_policy(str(vlm_folder))
    assert policy.vision is not None
    image_id = policy.vision.image_token_id
    # The screenshots' tokens are in the observations before turns 2 and 3, none in outputs.
    assert [list(t.input_token_ids).count(image_id) for t in row.turns] == [0, 0, 16, 16]
    assert not any(image_id in t.output_token_ids for t in row.turns)
    assert row.turns[2].input_text.endswith("Screenshot after click:[image]")
    assert len(row_images(row)) == 2


def test_a_vision_language_student_trains_on_pixels_with_its_vision_encoder_frozen(
    prepared: list[trajectory_pb2.Trajectory], vlm_folder: Path, tmp_path: Path
) -> None:
    data = tmp_path / "sft.jsonl"
    write_trajectories(data, prepared)
    before = load_policy(str(vlm_folder))
    assert before.frozen is not None and before.frozen.encoders == ("model.vision_tower",)
    start = {k: v.clone() for k, v in before.model.state_dict().items()}
    config = SftRunConfig(
        data=data,
        model=str(vlm_folder),
        output_dir=tmp_path / "run",
        engine=EngineConfig(micro_batch_size=2, total_steps=2, learning_rate=1e-2),
        progress=False,
        plot=False,
    )
    result = run_offline_sft(config, keep_engine=True)
    assert result.engine is not None
    try:
        end = result.engine.module.state_dict()
    finally:
        result.engine.close()

    # Two steps made one pass: the loss covered every assistant token, and nothing else.
    outputs = sum(len(t.output_token_ids) for row in prepared for t in row.turns)
    assert sum(s.loss_tokens for s in result.steps) == outputs

    def changed(prefix: str) -> list[bool]:
        return [not torch.equal(start[k], end[k]) for k in start if k.startswith(prefix)]

    assert changed("model.vision_tower.") and not any(changed("model.vision_tower."))
    # The projector only learns when the screenshots' features reach the loss.
    assert all(changed("model.multi_modal_projector."))
    assert any(changed("model.language_model."))


def test_a_text_student_refuses_screenshots_by_name(store: ArtifactStore, tmp_path: Path) -> None:
    result = prepare(store, tmp_path, "builtin:tiny", [gui_rollout(0)])
    assert (result.rows_rendered, result.rows_kept) == (0, 0)
    assert dict(result.unrendered_by_reason) == {"image_content": 1}
    (row,) = result.unrendered
    assert "builtin:browser-text" in row.detail and "messages[7]" in row.detail


def test_samples_hold_exactly_the_screenshots_whose_tokens_they_hold(
    prepared: list[trajectory_pb2.Trajectory], vlm_folder: Path
) -> None:
    policy = load_policy(str(vlm_folder))
    row = prepared[0]
    first, second = row_images(row)
    per_turn = policy.sft_samples(row, SampleConfig(per_turn=True))
    assert [s.images for s in per_turn if isinstance(s, VisionSample)] == [
        (),
        (),
        (first,),
        (first, second),
    ]
    image_id = policy.vision.image_token_id if policy.vision else -1
    tokens = [t for turn in row.turns for t in (*turn.input_token_ids, *turn.output_token_ids)]
    first_image = tokens.index(image_id)
    # A window whose left cut falls inside the first screenshot leaves all of it out.
    window = len(tokens) - (first_image + 3)
    (cut,) = policy.sft_samples(row, SampleConfig(context_window=window))
    assert isinstance(cut, VisionSample) and cut.images == (second,)
    assert cut.truncated == first_image + IMAGE_TOKENS
    assert cut.token_ids.count(image_id) == IMAGE_TOKENS
    # A row whose turns hold other image tokens than its conversation's images is malformed.
    changed = trajectory_pb2.Trajectory()
    changed.CopyFrom(row)
    conversation = json.loads(row.conversation_json)
    conversation[7]["content"] = "no screenshot"
    changed.conversation_json = json.dumps(conversation)
    with pytest.raises(TrajectoryError, match=r"hold 32 image token.*1 image.* make 16"):
        policy.sft_samples(changed, SampleConfig())
    failed = trajectory_pb2.Trajectory()
    failed.CopyFrom(row)
    failed.reward.value = -1.0  # no credit: no sample, and no image is read
    assert policy.sft_samples(failed, SampleConfig()) == [Skip(row.id, SkipReason.NO_LOSS_TOKENS)]


def _setup(tmp_path: Path, model: Path, mode: int, dataset: Path | None) -> RankSetup:
    spec = api.TrainingJobSpec(
        mode=mode,
        model=str(model),
        micro_batch_size=2,
        gradient_accumulation=1,
        learning_rate=1e-3,
        total_steps=2,
    )
    return RankSetup(
        job_id="vlm",
        spec=spec.SerializeToString(),
        model=str(model),
        scratch=str(tmp_path / "scratch"),
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=free_port(),
        dataset=None if dataset is None else str(dataset),
    )


def test_a_job_rank_trains_a_vision_language_student_and_saves_its_processor(
    prepared: list[trajectory_pb2.Trajectory], vlm_folder: Path, tmp_path: Path
) -> None:
    data = tmp_path / "sft.jsonl"
    write_trajectories(data, prepared)
    with pytest.raises(ValueError, match="vision-language model: it trains with SFT only"):
        RankTrainer(_setup(tmp_path, vlm_folder, api.TRAINING_MODE_RL, None))
    rank = RankTrainer(_setup(tmp_path, vlm_folder, api.TRAINING_MODE_SFT, data))
    try:
        assert rank.ready().buffered == 3
        (step,) = rank.run_steps(1)
        assert step.loss_tokens > 0
        info = rank.save("v1", {})
    finally:
        rank.close()
    # The checkpoint's model folder is a vision-language folder again, processor included.
    saved, original = load_policy(str(info.path / "model")), load_policy(str(vlm_folder))
    assert saved.vision is not None and original.vision is not None
    assert saved.vision.renderer.template == original.vision.renderer.template
