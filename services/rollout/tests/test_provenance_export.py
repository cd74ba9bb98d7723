"""Provenance records survive a JSON round trip and print in order; the dataset export gives the
captured tokens with masks, and marks what may not be trained on."""

from __future__ import annotations

import json
from pathlib import Path

from orchard.rollout.capture import CallRecord
from orchard.rollout.export import export_jsonl, rollout_rows
from orchard.rollout.provenance import (
    FailureLayer,
    InfraFailure,
    RewardEvidence,
    RewardRecord,
    RolloutRecord,
    ToolEvent,
    find_record,
    read_records,
    render_rollout,
    write_records,
)
from orchard.rollout.results import RolloutStatus


def call(seq: int, prompt: tuple[int, ...], output: tuple[int, ...], **extra: object) -> CallRecord:
    return CallRecord(
        rollout_id="r1",
        call_id=f"c{seq}",
        seq=seq,
        prompt_token_ids=prompt,
        output_token_ids=output,
        output_logprobs=tuple(-0.5 for _ in output),
        weight_version=f"v{seq}",
        finish_reason="stop",
        started_at=100.0 + seq,
        latency_s=0.1,
        output_text=f"reply {seq}",
        **extra,  # type: ignore[arg-type]
    )


def record() -> RolloutRecord:
    first = call(0, (1, 2), (3, 4), request_messages=({"role": "user", "content": "hi"},))
    second = call(
        1,
        (1, 2, 3, 4, 5),
        (6,),
        request_messages=(
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "reply 0"},
            {"role": "tool", "tool_call_id": "t", "content": "out"},
        ),
        tool_calls=(
            {"id": "t2", "type": "function", "function": {"name": "submit", "arguments": "{}"}},
        ),
    )
    summary = call(2, (1, 2, 3, 4, 5, 6, 9), (7,), branch="compaction")
    return RolloutRecord(
        rollout_id="r1",
        task_id="calc",
        harness="builtin:bash",
        started_at=100.0,
        ended_at=110.0,
        status=RolloutStatus.COMPLETED,
        outcome="submitted",
        sandbox_ids=["sb-1"],
        tool_events=[ToolEvent(100.5, 0.2, "sb-1", "bash", {"command": "ls"}, 0, "a.py", "t")],
        calls=[first, second, summary],
        reward=RewardRecord(
            1.0, "command_check", "the check passed", (RewardEvidence("$ make", "ok"),)
        ),
        steps=2,
        sampled_tokens=4,
    )


def test_records_round_trip_through_jsonl_and_print_in_time_order(tmp_path: Path) -> None:
    original = record()
    aborted = RolloutRecord(
        rollout_id="r2",
        task_id="calc",
        harness="builtin:bash",
        started_at=1.0,
        failure=InfraFailure(FailureLayer.SANDBOX_CREATE, "Unavailable: no agent", 3),
    )
    path = tmp_path / "records.jsonl"
    assert write_records([original, aborted], str(path)) == 2
    back = read_records(str(path))
    assert back[0] == original
    assert back[1].failure == aborted.failure
    assert back[1].status is RolloutStatus.ABORTED
    assert json.loads(path.read_text().splitlines()[0])["weight_versions"] == ["v0", "v1", "v2"]
    shown = render_rollout(find_record(back, "r1"))
    lines = shown.splitlines()
    assert lines[0] == "rollout r1  task calc  harness builtin:bash"
    order = [i for i, line in enumerate(lines) if "model" in line or "tool bash" in line]
    assert [lines[i].split()[2] for i in order] == ["model", "tool", "model", "model"]
    assert "model [compaction] #2" in shown
    assert "evidence $ make: ok" in shown
    assert "sandbox_create after 3 attempt(s)" in render_rollout(back[1])


def test_export_rows_carry_the_captured_tokens_masks_and_status(tmp_path: Path) -> None:
    rows = rollout_rows(record())
    main, compaction = rows
    assert main["token_ids"] == [1, 2, 3, 4, 5, 6]
    assert main["loss_mask"] == [0, 0, 1, 1, 0, 1]
    assert main["logprobs"] == [0.0, 0.0, -0.5, -0.5, 0.0, -0.5]
    assert main["messages"][-1]["tool_calls"][0]["function"]["name"] == "submit"
    assert main["messages"][:3] == list(record().calls[1].request_messages)
    assert (main["reward"], main["status"], main["trainable"]) == (1.0, "completed", True)
    assert main["weight_versions"] == ["v0", "v1"]
    assert compaction["branch"] == "compaction"
    assert compaction["trainable"] is False
    assert not any(compaction["loss_mask"])
    path = tmp_path / "data.jsonl"
    assert export_jsonl([record()], str(path)) == 2
    assert json.loads(path.read_text().splitlines()[0])["task_id"] == "calc"


def test_an_unscored_rollout_is_exported_but_not_trainable() -> None:
    aborted = record()
    aborted.status, aborted.reward = RolloutStatus.ABORTED, None
    rows = rollout_rows(aborted)
    assert (rows[0]["reward"], rows[0]["trainable"], rows[0]["status"]) == (None, False, "aborted")
    assert rollout_rows(RolloutRecord("r3", "calc", "builtin:bash")) == []
