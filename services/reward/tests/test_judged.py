"""Judge-backed scorers through the official openai client against a scripted HTTP server."""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import AsyncIterator, Iterator

import pytest

from orchard.core.errors import OrchardError
from orchard.reward.credit import TurnSpan
from orchard.reward.judge_client import JudgeEndpoint, OpenAIJudge, image_data_url
from orchard.reward.judged import TranscriptStep, assign_credit, grade_rubric, judge_outcome
from orchard.reward.outcome import Exclusion
from orchard.reward.rubric import Dimension

from .scripted_chat_server import ScriptedChatServer, Step, scripted_chat_server

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 16
STEPS = [
    TranscriptStep("ls", "README.md src tests"),
    TranscriptStep("cat src/calc.py", "def add(a, b): return a - b"),
    TranscriptStep("sed -i 's/a - b/a + b/' src/calc.py", ""),
    TranscriptStep("rm -rf tests", ""),
]


@pytest.fixture
def server() -> Iterator[ScriptedChatServer]:
    with scripted_chat_server() as running:
        yield running


@pytest.fixture
async def judge(server: ScriptedChatServer) -> AsyncIterator[OpenAIJudge]:
    endpoint = JudgeEndpoint(base_url=server.base_url, model="judge-test", timeout_s=1.0)
    async with OpenAIJudge(endpoint) as client:
        yield client


async def test_verdict_with_screenshots_as_data_urls(
    server: ScriptedChatServer, judge: OpenAIJudge
) -> None:
    server.play(Step(reply='Looking at it... {"success": true, "reason": "order placed"}'))
    shots = [PNG, JPEG, PNG, JPEG]
    result = await judge_outcome(
        judge, intent="buy milk", final_response="done", screenshots=shots, last_screenshots=2
    )
    assert (result.value, result.is_scored) == (1.0, True)
    sent = server.requests[0]
    assert sent["model"] == "judge-test"
    images = [part for part in sent["messages"][1]["content"] if part["type"] == "image_url"]
    assert [part["image_url"]["url"] for part in images] == [
        image_data_url(PNG),
        image_data_url(JPEG),
    ]
    assert (
        images[1]["image_url"]["url"] == "data:image/jpeg;base64," + base64.b64encode(JPEG).decode()
    )


async def test_http_500_garbage_and_timeout_are_retried(
    server: ScriptedChatServer, judge: OpenAIJudge
) -> None:
    server.play(
        Step(status=500),
        Step(raw_body=b"<html>not json</html>"),
        Step(reply='{"success": false, "reason": "wrong item"}'),
    )
    result = await judge_outcome(judge, intent="buy milk", final_response="")
    assert result.value == -1.0
    assert len(server.requests) == 3
    assert any("HTTP 500" in e.text for e in result.evidence)


async def test_every_attempt_failing_is_excluded_never_zero(
    server: ScriptedChatServer, judge: OpenAIJudge
) -> None:
    server.play(Step(delay_s=1.5), Step(status=500), Step(reply="I cannot decide."))
    result = await judge_outcome(judge, intent="buy milk", final_response="", format_variant=True)
    assert not result.is_scored
    assert result.exclusion is Exclusion.JUDGE_UNAVAILABLE
    texts = " ".join(e.text for e in result.evidence)
    assert "timed out" in texts
    assert "HTTP 500" in texts
    assert "no JSON object" in texts


async def test_unreachable_judge_is_excluded() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = JudgeEndpoint(base_url=f"http://127.0.0.1:{port}/v1", model="m", max_attempts=2)
    async with OpenAIJudge(endpoint) as judge:
        result = await judge_outcome(judge, intent="x", final_response="y")
    assert result.exclusion is Exclusion.JUDGE_UNAVAILABLE
    assert "unreachable" in result.detail


async def test_bad_inputs_are_invalid_argument(judge: OpenAIJudge) -> None:
    with pytest.raises(OrchardError, match="intent is empty"):
        await judge_outcome(judge, intent=" ", final_response="")
    with pytest.raises(OrchardError, match="PNG or JPEG"):
        await judge_outcome(judge, intent="x", final_response="", screenshots=[b"GIF89a"])
    with pytest.raises(OrchardError, match="empty"):
        await grade_rubric(judge, [], task="x")
    with pytest.raises(OrchardError, match="sum to 1"):
        await grade_rubric(judge, STEPS, task="x", dimensions=[Dimension("a", "x", 0.5)])


async def test_rubric_through_the_judge(server: ScriptedChatServer, judge: OpenAIJudge) -> None:
    dims = [Dimension("fix", "correct fix", 0.4), Dimension("verify", "ran tests", 0.6)]
    grades = {
        "fix": {"score": 1.0, "evidence": "sed fixed the sign", "turn": 2},
        "verify": {"score": 0.0, "evidence": "deleted the tests instead", "turn": 3},
    }
    server.play(
        Step(reply='{"grades": {"fix": {"score": 1.0}}}'),  # incomplete: retried
        Step(reply="```json\n" + json.dumps({"grades": grades}) + "\n```"),
    )
    result = await grade_rubric(judge, STEPS, task="fix add", dimensions=dims)
    assert result.value == pytest.approx(0.4)
    assert result.components == {"fix": 1.0, "verify": 0.0}
    assert "rm -rf tests" in server.requests[0]["messages"][1]["content"]


async def test_credit_assignment_through_the_judge(
    server: ScriptedChatServer, judge: OpenAIJudge
) -> None:
    good = {"values": [{"turn": 0, "value": 0.4}, {"turn": 2, "value": 0.8},
                       {"turn": 3, "value": 0.1}], "critical_turn": 3}  # fmt: skip
    server.play(
        Step(reply='{"values": [{"turn": 0, "value": 0.9}, {"turn": 3, "value": 0.1}]}'),
        Step(reply="Backward reasoning first.\n" + json.dumps(good)),
    )
    answer = await assign_credit(judge, STEPS, task="fix add", failure="tests deleted")
    assert answer.exclusion is None
    assert answer.curve is not None
    assert answer.curve.values == pytest.approx((0.4, 0.6, 0.8, 0.1))
    assert answer.curve.rise_segments == (TurnSpan(1, 2),)


async def test_credit_with_no_usable_answer_is_excluded(
    server: ScriptedChatServer, judge: OpenAIJudge
) -> None:
    server.play(
        Step(reply="no"), Step(reply='{"values": [{"turn": 0, "value": 2}]}'), Step(status=502)
    )
    answer = await assign_credit(judge, STEPS, task="fix add", failure="tests deleted")
    assert answer.curve is None
    assert answer.exclusion is not None
    assert answer.exclusion.exclusion is Exclusion.JUDGE_UNAVAILABLE
    assert len(answer.exclusion.evidence) == 3
