"""A scripted policy behind an endpoint of every API dialect harnesses use: a network-free teacher.

It plays a script of task plans. A plan matches a task by a piece of its instruction and holds
two ways through it: the solution and a plausible failure. On the first step of a conversation
the policy draws which one it follows (the plan's `solve_rate`), says so in its first thought,
and reads that thought back on later steps — so it needs no state and many conversations can
share one server. Each step is one tool call (OpenAI `tool_calls`), or a final answer.

A script may also bring the built-in GUI suite's teacher (`GuiTeacherSettings`), which the
scripted engine plays for conversations of the suite's tasks
(`orchard.rollout.gui_teacher_policy`); the server here plays the plans only.

The server speaks what the capture proxy speaks, through the same dialect modules
(`orchard.rollout.proxy`): `POST /v1/chat/completions`, `POST /v1/responses`, `POST /v1/messages`
(streaming or not; also `/v1/messages/count_tokens`), `GET /v1/models` and the side requests
harnesses make; bad requests get HTTP 400 in the dialect's error shape. Usage counts are
estimates (four characters a token): the policy has no tokenizer, and training never uses these
numbers — the capture proxy records real tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from orchard.rollout.proxy.anthropic_api import parse_messages_request
from orchard.rollout.proxy.http import (
    GENERATION_ROUTES,
    MESSAGES,
    ServedModel,
    add_side_routes,
    error_response,
    json_body,
    json_not_found,
    model_body,
    models_body,
    open_event_stream,
)
from orchard.rollout.proxy.turns import ApiError, Dialect, ModelTurn, TurnRequest
from orchard.rollout.teacher_tools import NoToolFits, adapt_step
from orchard.tasks.gui.suite import DEFAULT_COUNT, MAX_TASKS, MIN_TASKS

DEFAULT_MODEL = "orchard-scripted-policy"


@dataclass(frozen=True, slots=True)
class ScriptedStep:
    """One reply: a thought and, unless it is the final answer, one tool call."""

    thought: str
    tool: str = ""
    """Empty: a final answer without a tool call."""
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TaskPlan:
    match: str
    """A piece of the task's instruction that selects this plan."""
    solve_rate: float
    solution: tuple[ScriptedStep, ...]
    failure: tuple[ScriptedStep, ...]

    def __post_init__(self) -> None:
        if not 0.0 <= self.solve_rate <= 1.0:
            raise ValueError(f"plan {self.match!r}: solve_rate must be in [0, 1]")
        if not self.solution or not self.failure:
            raise ValueError(f"plan {self.match!r}: needs a solution and a failure, each a step")
        if self.solution[0].thought == self.failure[0].thought:
            raise ValueError(
                f"plan {self.match!r}: the first thoughts of solution and failure must differ "
                f"(the policy tells its path from them)"
            )


def _steps(data: Sequence[Mapping[str, Any]]) -> tuple[ScriptedStep, ...]:
    return tuple(
        ScriptedStep(str(s["thought"]), str(s.get("tool", "")), dict(s.get("arguments", {})))
        for s in data
    )


@dataclass(frozen=True, slots=True)
class GuiTeacherSettings:
    """The built-in GUI suite's scripted teacher as part of a script (`orchard.rollout.v1.
    GuiTeacher`): the suite its tasks come from and how often it errs."""

    suite_seed: int = 0
    count: int = DEFAULT_COUNT
    """Tasks in the suite (`orchard.tasks.gui.suite.generate_suite`), looked up by intent."""
    mistake_rate: float = 0.0
    """Chance, per click, typing or choosing step, of a wrong action in its place."""
    slip_share: float = 0.5
    """Share of those mistakes left uncorrected."""

    def __post_init__(self) -> None:
        if not MIN_TASKS <= self.count <= MAX_TASKS:
            raise ValueError(f"count {self.count} must lie in [{MIN_TASKS}, {MAX_TASKS}]")
        for name in ("mistake_rate", "slip_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:  # also refuses NaN
                raise ValueError(f"{name} {value} must lie in [0, 1]")


@dataclass(frozen=True, slots=True)
class PolicyScript:
    plans: tuple[TaskPlan, ...]
    model: str = DEFAULT_MODEL
    unknown_task_reply: str = "I do not know how to solve this task."
    gui_teacher: GuiTeacherSettings | None = None
    """The GUI teacher, for conversations of the suite's tasks; the plans answer the others."""

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PolicyScript:
        """From {"model"?, "plans": [{"match", "solve_rate", "solution": [steps], "failure":
        [steps]}]} with steps {"thought", "tool"?, "arguments"?}."""
        plans = tuple(
            TaskPlan(
                match=str(p["match"]),
                solve_rate=float(p["solve_rate"]),
                solution=_steps(p["solution"]),
                failure=_steps(p["failure"]),
            )
            for p in data["plans"]
        )
        return cls(plans=plans, model=str(data.get("model", DEFAULT_MODEL)))

    def plan_for(self, instruction: str) -> TaskPlan | None:
        for plan in self.plans:
            if plan.match in instruction:
                return plan
        return None


def _proto_steps(steps: Sequence[Any], where: str) -> tuple[ScriptedStep, ...]:
    """`orchard.rollout.v1.ScriptedStep` messages; ValueError names the bad one."""
    out = []
    for i, step in enumerate(steps):
        if not step.thought:
            raise ValueError(f"{where}[{i}].thought is empty")
        arguments: Any = {}
        if step.arguments_json:
            try:
                arguments = json.loads(step.arguments_json)
            except ValueError as exc:
                raise ValueError(f"{where}[{i}].arguments_json is not JSON: {exc}") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}[{i}].arguments_json must be a JSON object")
        out.append(ScriptedStep(step.thought, step.tool, arguments))
    return tuple(out)


def _gui_teacher_from_proto(message: Any) -> GuiTeacherSettings:
    """From an `orchard.rollout.v1.GuiTeacher` message; ValueError names the field."""
    if not 0 <= message.count <= MAX_TASKS:
        raise ValueError(
            f"gui_teacher.count {message.count} must lie in [0, {MAX_TASKS}] "
            f"(0: the suite's default, {DEFAULT_COUNT})"
        )
    try:
        return GuiTeacherSettings(
            suite_seed=message.suite_seed,
            count=message.count or DEFAULT_COUNT,
            mistake_rate=message.mistake_rate,
            slip_share=message.slip_share if message.HasField("slip_share") else 0.5,
        )
    except ValueError as exc:
        raise ValueError(f"gui_teacher.{exc}") from None


def script_from_proto(message: Any) -> PolicyScript:
    """A `PolicyScript` from an `orchard.rollout.v1.ScriptedPolicy` message; ValueError says
    which field is wrong."""
    gui_teacher = (
        _gui_teacher_from_proto(message.gui_teacher) if message.HasField("gui_teacher") else None
    )
    if not message.plans and gui_teacher is None:
        raise ValueError("plans is empty: give at least one plan, or a gui_teacher")
    plans = []
    for i, plan in enumerate(message.plans):
        where = f"plans[{i}]"
        if not plan.match:
            raise ValueError(f"{where}.match is empty: give a piece of the task's instruction")
        if not 0.0 <= plan.solve_rate <= 1.0:  # also refuses NaN
            raise ValueError(f"{where}.solve_rate {plan.solve_rate} must lie in [0, 1]")
        solution = _proto_steps(plan.solution, f"{where}.solution")
        failure = _proto_steps(plan.failure, f"{where}.failure")
        try:
            plans.append(TaskPlan(plan.match, plan.solve_rate, solution, failure))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return PolicyScript(
        plans=tuple(plans), model=message.model or DEFAULT_MODEL, gui_teacher=gui_teacher
    )


def content_text(content: Any) -> str:
    """A message's text: its content string, or its text parts joined (images left out)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def assistant_turns(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The text of each assistant turn: consecutive assistant messages are one turn (a
    Responses API history gives a turn's text and its function calls as separate items)."""
    turns: list[str] = []
    previous = ""
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            text = content_text(message.get("content"))
            if previous == "assistant":
                turns[-1] += text
            else:
                turns.append(text)
        previous = str(role)
    return turns


class ScriptedPolicy:
    """The decision logic, apart from HTTP.

    The task is found in any user message (harnesses put context of their own before it: an
    environment summary, reminders); each step's tool is said in the tools the request offers
    (`orchard.rollout.teacher_tools`: an abstract `shell` step becomes the harness's own shell
    tool). A step no offered tool can carry becomes a final answer saying so.
    """

    def __init__(self, script: PolicyScript, seed: int | None = None) -> None:
        self.script = script
        self.rng = random.Random(seed)

    def plan_for(self, messages: Sequence[Mapping[str, Any]]) -> TaskPlan | None:
        for message in messages:
            if message.get("role") == "user":
                plan = self.script.plan_for(content_text(message.get("content")))
                if plan is not None:
                    return plan
        return None

    def next_step(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        seed: int | None = None,
    ) -> ScriptedStep:
        """The reply to a conversation (OpenAI chat messages), given the tools the request
        offers (OpenAI function tools); its `tool` is an offered tool's name, or empty. A
        conversation's path (solution or failure) is drawn on its first step: from `seed`
        when given (the call's own, which the capture proxy draws per rollout), else from the
        policy's generator."""
        plan = self.plan_for(messages)
        if plan is None:
            return ScriptedStep(self.script.unknown_task_reply)
        replies = assistant_turns(messages)
        if not replies:
            draw = self.rng.random() if seed is None else random.Random(seed).random()
            path = plan.solution if draw < plan.solve_rate else plan.failure
        else:
            path = plan.failure if replies[0].startswith(plan.failure[0].thought) else plan.solution
        if len(replies) >= len(path):
            return ScriptedStep("I have nothing more to do.")
        step = path[len(replies)]
        if not step.tool:
            return step
        try:
            call = adapt_step(step.tool, step.arguments, tools)
        except NoToolFits as exc:
            return ScriptedStep(f"{step.thought} I cannot go on: {exc}.")
        return ScriptedStep(step.thought, call.name, call.arguments)


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)


class ScriptedPolicyServer:
    """Serves a `ScriptedPolicy` over HTTP; `async with` starts and stops it.

    `base_url` (".../v1") is what an OpenAI client takes once started; `root_url` (without
    "/v1") is what an Anthropic client takes.
    """

    def __init__(
        self,
        script: PolicyScript,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int | None = None,
    ) -> None:
        self.policy = ScriptedPolicy(script, seed)
        self.host = host
        self.port = port
        self.requests = 0
        app = web.Application(middlewares=[json_not_found])
        for path, dialect in GENERATION_ROUTES:
            app.router.add_post(path, self._handler(dialect))
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model_id:.+}", self._model)
        add_side_routes(app.router, "", self._served_model)
        self._runner = web.AppRunner(app, access_log=None)
        self._site: web.TCPSite | None = None

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    async def start(self) -> str:
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.host, self.port)
        await self._site.start()
        # The port the system chose when asked for 0.
        self.port = int(self._runner.addresses[0][1])
        return self.base_url

    async def close(self) -> None:
        await self._runner.cleanup()

    async def __aenter__(self) -> ScriptedPolicyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _served_model(self) -> ServedModel:
        return ServedModel(self.policy.script.model)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(models_body(request, self._served_model()))

    async def _model(self, request: web.Request) -> web.Response:
        return web.json_response(model_body(request, ServedModel(request.match_info["model_id"])))

    async def _count_tokens(self, request: web.Request) -> web.Response:
        try:
            turn = parse_messages_request(await json_body(request), counting=True)
        except ApiError as e:
            return error_response(e, MESSAGES, request)
        return web.json_response({"input_tokens": _prompt_tokens(turn)})

    def _handler(self, dialect: Dialect) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._reply(request, dialect)

        return handle

    async def _reply(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        try:
            turn_request = dialect.parse(await json_body(request))
        except ApiError as e:
            return error_response(e, dialect, request)
        self.requests += 1
        step = self.policy.next_step(turn_request.messages, turn_request.tools)
        tool_calls: tuple[dict[str, Any], ...] = ()
        if step.tool:
            tool_calls = (
                {
                    "id": dialect.new_tool_call_id(),
                    "type": "function",
                    "function": {"name": step.tool, "arguments": json.dumps(step.arguments)},
                },
            )
        turn = ModelTurn(
            id=dialect.new_turn_id(),
            created=int(time.time()),
            model=turn_request.model or self.policy.script.model,
            content=step.thought,
            tool_calls=tool_calls,
            finish_reason="tool_calls" if tool_calls else "stop",
            prompt_tokens=_prompt_tokens(turn_request),
            completion_tokens=_estimate_tokens(step.thought + json.dumps(step.arguments)),
        )
        if not turn_request.stream:
            return web.json_response(dialect.answer(turn, turn_request))
        events = dialect.stream(
            turn_request, turn_id=turn.id, model=turn.model, prompt_tokens=turn.prompt_tokens
        )
        response = await open_event_stream(request)
        await response.write(events.opening() + events.turn(turn))
        await response.write_eof()
        return response


def _prompt_tokens(request: TurnRequest) -> int:
    return sum(_estimate_tokens(content_text(m.get("content"))) for m in request.messages)


async def serve_forever(server: ScriptedPolicyServer) -> None:
    async with server:
        await asyncio.Event().wait()
