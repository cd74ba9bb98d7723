"""The built-in GUI suite's scripted teacher as a job's scripted policy: a `ScriptedEngine` with a
GUI teacher behind a REAL capture proxy, asked through the official OpenAI client with the
conversation the GUI harness sends (the intent, then observation summaries, older ones without
their page text), each returned call run in a REAL Chromium on the REAL site server, and the
task's check read from the site's server-side state; the same through the service's engine pool
(`_start_scripted`). Bad GUI teachers are refused by the REAL rollout gRPC server. A missing
Chromium or playwright fails these tests; it never skips them."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import pytest_asyncio
from transformers import PreTrainedTokenizerBase

from orchard.core.config import ServerConfig
from orchard.core.errors import error_info
from orchard.core.etcd import EmbeddedEtcd
from orchard.lm.tokenizer import build_tokenizer
from orchard.rollout.config import RolloutConfig
from orchard.rollout.engine_pool import EnginePool
from orchard.rollout.engines.base import InvalidRequest, SamplingParams
from orchard.rollout.engines.scripted import ScriptedEngine
from orchard.rollout.gui_teacher_policy import UNREAD_LIMIT
from orchard.rollout.main import RolloutApplication
from orchard.rollout.metrics import RolloutMetrics
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig
from orchard.rollout.scripted_policy import script_from_proto
from orchard.rollout.service import JobPolicyKey
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.rollout.v1 import rollout_service_pb2_grpc
from orchard.tasks.gui.actions import tool_schemas
from orchard.tasks.gui.browser import BrowserConfig, BrowserSession
from orchard.tasks.gui.observation import Observation
from orchard.tasks.gui.sites import SiteServer, fetch_state
from orchard.tasks.gui.suite import MAX_TASKS, GuiTask, generate_suite, serve_task

pytestmark = pytest.mark.timeout(120)
on_module_loop = pytest.mark.asyncio(loop_scope="module")

SUITE_SEED, COUNT = 3, 15
SUITE = generate_suite(COUNT, seed=SUITE_SEED)
SHOP_ADD = next(t for t in SUITE if t.family == "shop_add")
WIKI_SEARCH = next(t for t in SUITE if t.family == "wiki_search")
TOOLS = tool_schemas()
SYSTEM = "You operate a web browser through its tools. Finish with done."
TOKEN = "gui-teacher-token"
LEFT_OUT = "(page text left out: an older observation)"
BROWSER_CONFIG = BrowserConfig(action_timeout_s=5.0, settle_timeout_s=1.5)


def _script(**teacher: Any) -> api.ScriptedPolicy:
    plan = api.ScriptedPlan(
        match="Water the plants",
        solve_rate=1.0,
        solution=[api.ScriptedStep(thought="I water them.")],
        failure=[api.ScriptedStep(thought="I forget them.")],
    )
    gui_teacher = api.GuiTeacher(suite_seed=SUITE_SEED, count=COUNT, **teacher)
    return api.ScriptedPolicy(model="gui-teacher", plans=[plan], gui_teacher=gui_teacher)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return build_tokenizer()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[BrowserSession]:
    async with BrowserSession(BROWSER_CONFIG) as session:
        yield session


@asynccontextmanager
async def _teacher_proxy(
    tokenizer: PreTrainedTokenizerBase, script: api.ScriptedPolicy, sampling_seed: int = 7
) -> AsyncIterator[tuple[CaptureProxy, ScriptedEngine]]:
    """The engine and proxy `_start_scripted` builds for a job's script, the proxy seeded as
    for a script with a seed."""
    engine = ScriptedEngine(script_from_proto(script), tokenizer)
    config = CaptureProxyConfig(settle_quiet_s=0.05, sampling_seed=sampling_seed)
    async with CaptureProxy(engine, config) as proxy:
        yield proxy, engine


@dataclasses.dataclass
class _Episode:
    """One conversation as the GUI harness holds it, played in one browser."""

    client: openai.AsyncOpenAI
    browser: BrowserSession
    task: GuiTask
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    observations: dict[int, Observation] = dataclasses.field(default_factory=dict)
    """Index in `messages` -> the observation it shows."""
    calls: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)
    thoughts: list[str] = dataclasses.field(default_factory=list)
    response: str | None = None

    async def start(self, base_url: str) -> None:
        tabs = len((await self.browser.observe()).tabs)
        for index in reversed(range(1, tabs)):
            await self.browser.close_tab(index)
        first = await self.browser.goto_url(self.task.start_url(base_url))
        self.messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"  {self.task.intent}\n"},
            {"role": "user", "content": [{"type": "text", "text": first.summary()}]},
        ]
        self.observations = {2: first}

    async def ask(self) -> Any:
        """The teacher's next turn for the conversation so far (older observations without
        their page text, as the harness sends them)."""
        latest = max(self.observations)
        for index, observation in self.observations.items():
            if index != latest:
                shown = dataclasses.replace(observation, page_text=LEFT_OUT)
                self.messages[index]["content"] = shown.summary()
        chat = await self.client.chat.completions.create(
            model="teacher", messages=self.messages, tools=TOOLS
        )
        return chat.choices[0].message

    async def step(self, *, retry: bool = False) -> bool:
        """One call of the teacher run in the browser; True once it called done. ``retry``:
        the request is sent twice first (a harness's retry), and must get the same turn."""
        message = await self.ask()
        if retry:
            again = await self.ask()
            assert (again.content, _call(again)) == (message.content, _call(message))
        [call] = message.tool_calls
        name, arguments = _call(message)
        observation = await self.browser.call(name, arguments)
        self.calls.append((name, arguments))
        self.thoughts.append(message.content)
        self.messages += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": observation.summary()},
        ]
        self.observations[len(self.messages) - 1] = observation
        if observation.done:
            self.response = observation.response
        return observation.done


def _call(message: Any) -> tuple[str, dict[str, Any]]:
    [call] = message.tool_calls
    return call.function.name, json.loads(call.function.arguments)


@asynccontextmanager
async def _episode(
    proxy: CaptureProxy, rollout_id: str, browser: BrowserSession, task: GuiTask
) -> AsyncIterator[tuple[_Episode, SiteServer]]:
    """A capture session, the task's site and the conversation's start in ``browser``."""
    endpoint = proxy.open_session(rollout_id)
    async with openai.AsyncOpenAI(
        base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
    ) as client:
        with serve_task(task, state_token=TOKEN) as server:
            episode = _Episode(client, browser, task)
            await episode.start(server.base_url)
            yield episode, server
    await proxy.settle(rollout_id, timeout=10)
    proxy.close_session(rollout_id)


def _verdict(episode: _Episode, server: SiteServer) -> tuple[bool, str]:
    state = fetch_state(server.base_url, episode.task.site, token=TOKEN)
    result = episode.task.check(state, episode.response)
    return result.success, result.detail


async def _play(
    proxy: CaptureProxy, rollout_id: str, browser: BrowserSession, task: GuiTask
) -> tuple[_Episode, bool, str]:
    """The task played to ``done`` in one capture session; the episode and the check's
    verdict on the site's state."""
    async with _episode(proxy, rollout_id, browser, task) as (episode, server):
        for _ in range(2 * task.max_steps):
            if await episode.step():
                break
        success, detail = _verdict(episode, server)
    return episode, success, detail


@on_module_loop
async def test_the_teacher_solves_easy_tasks_through_the_proxy(
    tokenizer: PreTrainedTokenizerBase, browser: BrowserSession
) -> None:
    calls = 0
    async with _teacher_proxy(tokenizer, _script()) as (proxy, engine):
        for number, task in enumerate((SHOP_ADD, WIKI_SEARCH)):
            assert task.difficulty == 1
            episode, success, detail = await _play(proxy, f"gui.{number}", browser, task)
            assert success, (task.id, detail, episode.calls)
            assert episode.calls[-1][0] == "done"
            assert len(episode.calls) <= task.max_steps
            # Each turn says what the teacher meant by its call.
            assert all(episode.thoughts), episode.thoughts
            calls += len(episode.calls)
    assert engine.turns == calls


@on_module_loop
async def test_two_sessions_of_one_task_are_played_apart_when_interleaved(
    tokenizer: PreTrainedTokenizerBase, browser: BrowserSession
) -> None:
    task = SHOP_ADD
    async with (
        _teacher_proxy(tokenizer, _script()) as (proxy, _),
        BrowserSession(BROWSER_CONFIG) as second_browser,
        _episode(proxy, "apart.0", browser, task) as (first, first_site),
        _episode(proxy, "apart.1", second_browser, task) as (second, second_site),
    ):
        # The second starts a step behind, so the two are never at the same step.
        finished = {id(first): await first.step(retry=True), id(second): False}
        for _ in range(2 * task.max_steps):
            for episode in (first, second):
                if not finished[id(episode)]:
                    # A conversation's first request is sent twice, as a harness retries.
                    finished[id(episode)] = await episode.step(retry=not episode.calls)
            if all(finished.values()):
                break
        verdicts = [_verdict(first, first_site), _verdict(second, second_site)]
    assert verdicts == [(True, verdicts[0][1]), (True, verdicts[1][1])], verdicts
    # Mistake-free teachers of one task do the same, whatever the other session does.
    assert first.calls == second.calls
    assert [name for name, _ in first.calls] == ["write", "click", "done"]


@on_module_loop
async def test_mistakes_follow_the_session_s_seed(
    tokenizer: PreTrainedTokenizerBase, browser: BrowserSession
) -> None:
    task = WIKI_SEARCH
    async with _teacher_proxy(tokenizer, _script()) as (proxy, _):
        clean, success, detail = await _play(proxy, "clean.0", browser, task)
    assert success, detail
    # Every step errs; every mistake is a detour the teacher undoes.
    noisy = _script(mistake_rate=1.0, slip_share=0.0)
    runs = {}
    async with _teacher_proxy(tokenizer, noisy) as (proxy, _):
        # One rollout's retries (ids that differ only in their random tail) draw the same seed.
        for rollout_id in ("noisy.0.0123456789", "noisy.0.abcdefabcd", "noisy.1", "noisy.2"):
            episode, success, detail = await _play(proxy, rollout_id, browser, task)
            assert success, (rollout_id, detail, episode.calls)
            runs[rollout_id] = episode.calls
    first = runs["noisy.0.0123456789"]
    assert first == runs["noisy.0.abcdefabcd"]
    assert len(first) > len(clean.calls)
    query = task.goal["query"]
    typed = [arguments["text"] for name, arguments in first if name == "write"]
    assert typed[-1] == query and any(text != query for text in typed), typed
    assert runs["noisy.1"] != first or runs["noisy.2"] != first


@on_module_loop
async def test_a_conversation_of_no_suite_task_gets_the_plans_or_a_final_answer(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    without_plans = _script()
    del without_plans.plans[:]
    for script, reply in (
        (_script(), "I water them."),
        (without_plans, "I do not know how to solve this task."),
    ):
        async with _teacher_proxy(tokenizer, script) as (proxy, _):
            endpoint = proxy.open_session("other")
            async with openai.AsyncOpenAI(
                base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
            ) as client:
                for intent, expected in (
                    ("Water the plants on the balcony.", reply),
                    ("Feed the cat.", "I do not know how to solve this task."),
                ):
                    chat = await client.chat.completions.create(
                        model="teacher",
                        messages=[
                            {"role": "system", "content": SYSTEM},
                            {"role": "user", "content": intent},
                            {"role": "user", "content": "viewport: 1x1"},
                        ],
                        tools=TOOLS,
                    )
                    message = chat.choices[0].message
                    assert (message.content, message.tool_calls) == (expected, None), intent


@on_module_loop
async def test_calls_the_teacher_cannot_answer_are_refused_saying_why(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    blank = Observation("observe", True, "the current page", None, (1280, 800), (), page_text="")
    conversation = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": SHOP_ADD.intent},
        {"role": "user", "content": blank.summary()},
    ]
    engine = ScriptedEngine(script_from_proto(_script()), tokenizer)
    with pytest.raises(InvalidRequest, match="capture session"):
        await engine.decide(conversation, TOOLS, SamplingParams())
    # Nothing to aim at on a blank page: the teacher waits; a harness that offers no wait
    # gets a final answer saying so.
    text, calls = await engine.decide(conversation, TOOLS, SamplingParams(session="s-1"))
    assert [c.name for c in calls] == ["wait"], text
    no_wait = [t for t in TOOLS if t["function"]["name"] != "wait"]
    text, calls = await engine.decide(conversation, no_wait, SamplingParams(session="s-2"))
    assert not calls and "I cannot go on: the harness offers no tool 'wait'" in text, text
    refused = [*conversation, {"role": "assistant", "content": "I look."}]
    refused.append({"role": "user", "content": "not run: no tool 'look'"})
    with pytest.raises(InvalidRequest, match="no observation"):
        await engine.decide(refused, TOOLS, SamplingParams(session="s-1"))
    # A conversation past its first reply whose teacher this engine never made.
    with pytest.raises(InvalidRequest, match="is gone"):
        await engine.decide(refused[:-1] + conversation[-1:], TOOLS, SamplingParams(session="s-9"))

    # A page that could not be read as text (the harness says so) gets a wait, a few times.
    unread = dataclasses.replace(blank, page_text=None).summary()
    unread += "\n(the page could not be read as text this time)"
    messages = [*conversation[:2], {"role": "user", "content": unread}]
    async with _teacher_proxy(tokenizer, _script()) as (proxy, _):
        endpoint = proxy.open_session("unread")
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
        ) as client:
            for _ in range(UNREAD_LIMIT):
                chat = await client.chat.completions.create(
                    model="teacher", messages=messages, tools=TOOLS
                )
                message = chat.choices[0].message
                assert _call(message) == ("wait", {"seconds": 1}), message
                messages += [
                    message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": unread},
                ]
            with pytest.raises(openai.BadRequestError, match="in a row have no page text"):
                await client.chat.completions.create(
                    model="teacher", messages=messages, tools=TOOLS
                )


@on_module_loop
async def test_the_service_s_engine_pool_plays_a_script_of_a_gui_teacher_alone(
    browser: BrowserSession, caplog: pytest.LogCaptureFixture
) -> None:
    script = api.ScriptedPolicy(gui_teacher=api.GuiTeacher(suite_seed=SUITE_SEED, count=COUNT))
    key = JobPolicyKey(
        "gui-teacher", "", 1.0, 256, script=script.SerializeToString(deterministic=True)
    )
    pool = EnginePool(RolloutConfig(), RolloutMetrics(None))
    caplog.set_level(logging.INFO, logger="orchard.rollout.engine_pool")
    started = await pool.acquire(key)
    try:
        assert started.proxy is not None
        async with _episode(started.proxy, "pooled.0", browser, SHOP_ADD) as (episode, server):
            done = [await episode.step() for _ in range(3)]
            success, detail = _verdict(episode, server)
    finally:
        await pool.release(key, started)
    assert done == [False, False, True] and success, detail
    assert "scripted, GUI teacher over 15 tasks, behind" in caplog.text


def test_a_gui_teacher_script_needs_no_plans_and_takes_the_proto_s_defaults() -> None:
    script = script_from_proto(api.ScriptedPolicy(gui_teacher=api.GuiTeacher(suite_seed=4)))
    assert script.plans == () and script.gui_teacher is not None
    assert (script.gui_teacher.count, script.gui_teacher.slip_share) == (60, 0.5)
    zero = api.GuiTeacher(count=MAX_TASKS, mistake_rate=1.0, slip_share=0.0)
    settings = script_from_proto(api.ScriptedPolicy(gui_teacher=zero)).gui_teacher
    assert settings is not None and (settings.count, settings.slip_share) == (MAX_TASKS, 0.0)


async def _refused(call: Any) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    info = error_info(caught.value)
    return caught.value.code(), caught.value.details() or "", info.reason if info else ""


@on_module_loop
async def test_bad_gui_teachers_are_invalid_argument_naming_the_field(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    config = RolloutConfig(
        server=ServerConfig(listen=["127.0.0.1:0"]),
        artifacts={"root": (tmp_path / "artifacts").as_uri()},
        etcd={"endpoints": [etcd.endpoint], "namespace": f"gui-teacher-{os.urandom(4).hex()}/"},
        # Never reached: every job here is refused before it exists.
        env={"endpoint": "127.0.0.1:9"},
    )
    cases = [
        (api.GuiTeacher(mistake_rate=1.5), "gui_teacher.mistake_rate 1.5 must lie in [0, 1]"),
        (api.GuiTeacher(mistake_rate=-0.1), "gui_teacher.mistake_rate -0.1 must lie in [0, 1]"),
        (api.GuiTeacher(mistake_rate=math.nan), "gui_teacher.mistake_rate nan"),
        (api.GuiTeacher(slip_share=2.0), "gui_teacher.slip_share 2.0 must lie in [0, 1]"),
        (api.GuiTeacher(count=-1), "gui_teacher.count -1 must lie in [0, 1500]"),
        (api.GuiTeacher(count=MAX_TASKS + 1), f"gui_teacher.count {MAX_TASKS + 1} must lie"),
    ]
    async with RolloutApplication(config).server() as server:
        await server.set_serving()
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            stub = rollout_service_pb2_grpc.RolloutServiceStub(channel)
            for teacher, message in [*cases, (None, "plans is empty")]:
                script = api.ScriptedPolicy()
                if teacher is not None:
                    script.gui_teacher.CopyFrom(teacher)
                spec = api.RolloutJobSpec(
                    tasks=[
                        api.RolloutTask(
                            id="t1",
                            instruction=SHOP_ADD.intent,
                            scorer_json=json.dumps({"check": {"command": "true"}}),
                        )
                    ],
                    harnesses=["builtin:bash"],
                    policy_spec=api.PolicySpec(scripted=script),
                )
                request = api.CreateRolloutJobRequest(spec=spec)
                code, details, reason = await _refused(stub.CreateRolloutJob(request, timeout=10))
                assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
                assert f"spec.policy_spec.scripted.{message}" in details, details
            listed = await stub.ListRolloutJobs(api.ListRolloutJobsRequest())
    assert list(listed.jobs) == []
