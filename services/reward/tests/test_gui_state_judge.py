"""JudgeOutcome's built-in state judge (``builtin:gui-state``) through the REAL reward gRPC
server: a real orchard-env (``conftest.py``; root), a real browser episode (the site sandbox
serving one task's world, Chromium in the browser sandbox) driven by the scripted teacher, and
the reward read from the site's server-side state."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from orchard.core.config import ServerConfig
from orchard.core.errors import error_info
from orchard.reward.config import RewardConfig
from orchard.reward.gui_state import GUI_STATE_JUDGE
from orchard.reward.main import RewardApplication
from orchard.reward.v1 import reward_service_pb2 as api
from orchard.reward.v1 import reward_service_pb2_grpc
from orchard.sdk import AsyncSandboxClient
from orchard.sdk.cli.stack import LocalStack
from orchard.tasks.gui.browser_dir import LAUNCHER, build_browser_dir
from orchard.tasks.gui.episode import BrowserEpisode, BrowserSandboxSettings
from orchard.tasks.gui.suite import make_task
from orchard.tasks.gui.teacher import ScriptedGuiTeacher
from orchard.types.v1 import reward_pb2

pytestmark = [pytest.mark.asyncio(loop_scope="module")]

ROOT = Path(__file__).resolve().parents[3]
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
TASK = make_task(0, "warmup", 0)  # search the playground for 'lumen brisk'
LOOKUP = make_task(0, "warmup", 3)  # the same site; scored on the answer: the help code


@pytest.fixture(scope="module")
def browser_dir() -> str:
    """The folder `make gui-browser` builds; the host image shows it at the same path."""
    folder = Path(os.environ.get("ORCHARD_GUI_BROWSER") or ROOT / ".cache" / "gui-browser")
    if not (folder / LAUNCHER).exists():
        build_browser_dir(folder)
    return str(folder.absolute())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(env_stack: LocalStack) -> AsyncIterator[AsyncSandboxClient]:
    async with AsyncSandboxClient(env_stack.endpoint, token=env_stack.token) as made:
        yield made


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def episode(client: AsyncSandboxClient, browser_dir: str) -> AsyncIterator[BrowserEpisode]:
    """One episode of `TASK` for the whole module (opening one costs seconds); Chromium's own
    sandbox off, so the stack needs no user namespaces."""
    settings = BrowserSandboxSettings(browser_dir=browser_dir, chromium_sandbox=False)
    async with await BrowserEpisode.open(
        client, settings, sites=[TASK.site], worlds={TASK.site: TASK.initial_state}
    ) as opened:
        yield opened


def _judge(episode: BrowserEpisode, **fields: Any) -> api.JudgeOutcomeRequest:
    request = {
        "judge": GUI_STATE_JUDGE,
        "intent": TASK.intent,
        "task_id": TASK.id,
        "site_sandbox_id": episode.site.id,
        **fields,
    }
    return api.JudgeOutcomeRequest(**request)


async def _scored(
    reward: reward_service_pb2_grpc.RewardServiceStub, request: api.JudgeOutcomeRequest
) -> reward_pb2.Reward:
    reply = await reward.JudgeOutcome(request, timeout=60)
    assert reply.reward.status == reward_pb2.REWARD_STATUS_SCORED, reply.reward.detail
    assert reply.reward.scorer == "gui_state_judge"
    return reply.reward


@pytest.mark.root
@pytest.mark.slow
async def test_the_state_judge_scores_the_start_state_and_the_goal_state(
    env_reward: reward_service_pb2_grpc.RewardServiceStub, episode: BrowserEpisode
) -> None:
    untouched = await _scored(env_reward, _judge(episode, screenshots=[PNG, PNG]))
    assert untouched.value == -1.0
    assert "FAILED: searched for 'lumen brisk'" in untouched.detail
    evidence = {e.title: e.text for e in untouched.evidence}
    assert '"searches":[]' in evidence["playground state"]
    assert evidence["screenshots"].startswith("2 came")
    assert untouched.components["screenshots"] == 2.0
    assert untouched.components["goal_share"] == 0.0
    format_zero = await _scored(env_reward, _judge(episode, format_variant=True))
    assert format_zero.value == 0.0

    # The teacher plays the task in the browser, reading each observation's page text.
    teacher = ScriptedGuiTeacher(TASK, base_url=episode.base_url)
    observation = await episode.call("goto_url", {"url": TASK.start_url(episode.base_url)})
    for _ in range(TASK.max_steps):
        call = teacher.next_call(observation)
        observation = await episode.call(call.name, call.arguments)
        if observation.done:
            break
    assert observation.done and observation.response, observation.summary()

    done = _judge(episode, final_response=observation.response)
    solved = await _scored(env_reward, done)
    assert solved.value == 1.0 and solved.components["goal_share"] == 1.0
    assert "ok: searched for 'lumen brisk'" in solved.detail
    assert "lumen brisk" in {e.title: e.text for e in solved.evidence}["playground state"]
    # The format variant: +1 only when every turn parsed; -1 at the limit (3), success or not.
    for failures, value in [(0, 1.0), (1, 0.0), (2, 0.0), (3, -1.0)]:
        done.format_variant, done.policy_format_failures = True, failures
        assert (await _scored(env_reward, done)).value == value, failures

    # A lookup is scored on the final response (the site's state is read all the same).
    answer = _judge(episode, task_id=LOOKUP.id, intent=LOOKUP.intent)
    code = LOOKUP.goal["expected"][0]
    answer.final_response = f"The help code is {code}."
    assert (await _scored(env_reward, answer)).value == 1.0
    answer.final_response = "The help code is ORCHID-7."
    assert (await _scored(env_reward, answer)).value == -1.0


@pytest.mark.root
@pytest.mark.slow
async def test_a_site_that_gives_no_state_is_excluded_never_scored(
    env_reward: reward_service_pb2_grpc.RewardServiceStub, episode: BrowserEpisode
) -> None:
    """Runs last: it deletes the module's site sandbox."""
    for request, says in [
        (_judge(episode, site_port=9), "could not be read on port 9"),
        (_judge(episode, site_sandbox_id="sbx-never-made"), "does not exist"),
    ]:
        reply = await env_reward.JudgeOutcome(request, timeout=60)
        assert reply.reward.status == reward_pb2.REWARD_STATUS_EXCLUDED, reply.reward.detail
        assert reply.reward.exclusion == reward_pb2.EXCLUSION_REASON_SANDBOX_FAILURE
        assert says in reply.reward.detail
    await episode.site.delete()
    reply = await env_reward.JudgeOutcome(_judge(episode, format_variant=True), timeout=60)
    assert reply.reward.status == reward_pb2.REWARD_STATUS_EXCLUDED
    assert reply.reward.exclusion == reward_pb2.EXCLUSION_REASON_SANDBOX_FAILURE
    assert episode.site.id in reply.reward.detail and reply.reward.value == 0.0


async def _refused(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    info = error_info(caught.value)
    assert info is not None and info.reason == caught.value.code().name
    return caught.value.code(), caught.value.details() or ""


async def test_bad_state_judge_requests_are_refused_before_any_sandbox() -> None:
    """On a server without an environment service: every request below is refused by its
    fields alone, and a good one by the missing service."""
    config = RewardConfig(server=ServerConfig(listen=["127.0.0.1:0"]))
    async with RewardApplication(config).server() as server:
        await server.set_serving()
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            stub = reward_service_pb2_grpc.RewardServiceStub(channel)
            good = {
                "judge": GUI_STATE_JUDGE,
                "intent": TASK.intent,
                "task_id": TASK.id,
                "site_sandbox_id": "sbx-1",
            }
            invalid = [
                ({"task_id": ""}, "needs task_id"),
                ({"task_id": "claw/0/reply_mail/0"}, "built-in GUI task id"),
                ({"site_sandbox_id": ""}, "needs site_sandbox_id"),
                ({"site_port": 65536}, "site_port must lie in [0, 65535]"),
                ({"site_port": -1}, "site_port must lie in [0, 65535]"),
                ({"policy_format_failures": -1}, "must not be negative"),
                ({"intent": ""}, "intent is empty"),
            ]
            for change, message in invalid:
                request = api.JudgeOutcomeRequest(**{**good, **change})
                code, details = await _refused(stub.JudgeOutcome(request))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, change
                assert message in details, details
            for task_id, message in [
                ("gui/0/juggling/0", "unknown GUI family"),
                ("gui/0/warmup/x", "whole numbers"),
            ]:
                request = api.JudgeOutcomeRequest(**{**good, "task_id": task_id})
                code, details = await _refused(stub.JudgeOutcome(request))
                assert (code, message in details) == (grpc.StatusCode.NOT_FOUND, True), details
            code, details = await _refused(stub.JudgeOutcome(api.JudgeOutcomeRequest(**good)))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "env.endpoint" in details
            # A person who names a wrong judge learns that the state judge exists.
            wrong = api.JudgeOutcomeRequest(intent="x", judge="builtin:gui")
            code, details = await _refused(stub.JudgeOutcome(wrong))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and GUI_STATE_JUDGE in details
            trajectory = api.AssignCreditRequest(judge=GUI_STATE_JUDGE)
            trajectory.trajectory.turns.add(index=0, input_text="task", output_text="act")
            code, details = await _refused(stub.AssignCredit(trajectory))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "JudgeOutcome only" in details
