"""A scripted policy behind an OpenAI-compatible chat-completions endpoint: a network-free teacher.

It plays a script of task plans. A plan matches a task by a piece of its instruction and holds
two ways through it: the solution and a plausible failure. On the first step of a conversation
the policy draws which one it follows (the plan's `solve_rate`), says so in its first thought,
and reads that thought back on later steps — so it needs no state and many conversations can
share one server. Each step is one tool call (OpenAI `tool_calls`), or a final answer.

`POST /v1/chat/completions` (streaming or not) and `GET /v1/models`; bad requests get HTTP 400
with an OpenAI error body. Usage counts are estimates (four characters a token): the policy has
no tokenizer, and training never uses these numbers — the capture proxy records real tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

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
class PolicyScript:
    plans: tuple[TaskPlan, ...]
    model: str = DEFAULT_MODEL
    unknown_task_reply: str = "I do not know how to solve this task."

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


def script_from_proto(message: Any) -> PolicyScript:
    """A `PolicyScript` from an `orchard.rollout.v1.ScriptedPolicy` message; ValueError says
    which field is wrong."""
    if not message.plans:
        raise ValueError("plans is empty: give at least one plan")
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
    return PolicyScript(plans=tuple(plans), model=message.model or DEFAULT_MODEL)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


class ScriptedPolicy:
    """The decision logic, apart from HTTP."""

    def __init__(self, script: PolicyScript, seed: int | None = None) -> None:
        self.script = script
        self.rng = random.Random(seed)

    def next_step(self, messages: Sequence[Mapping[str, Any]]) -> ScriptedStep:
        users = [m for m in messages if m.get("role") == "user"]
        instruction = _content_text(users[0].get("content")) if users else ""
        plan = self.script.plan_for(instruction)
        if plan is None:
            return ScriptedStep(self.script.unknown_task_reply)
        replies = [m for m in messages if m.get("role") == "assistant"]
        if not replies:
            path = plan.solution if self.rng.random() < plan.solve_rate else plan.failure
        else:
            first = _content_text(replies[0].get("content"))
            path = plan.failure if first.startswith(plan.failure[0].thought) else plan.solution
        if len(replies) >= len(path):
            return ScriptedStep("I have nothing more to do.")
        return path[len(replies)]


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": None}}
    return web.json_response(body, status=status)


class ScriptedPolicyServer:
    """Serves a `ScriptedPolicy` over HTTP; `async with` starts and stops it.

    `base_url` (".../v1") is what an OpenAI client takes once started.
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
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        self._site: web.TCPSite | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

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

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.policy.script.model, "object": "model", "owned_by": "orchard"}
        return web.json_response({"object": "list", "data": [model]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return _error(400, "`messages` must be a list of message objects")
        self.requests += 1
        step = self.policy.next_step(messages)
        offered = {
            t.get("function", {}).get("name")
            for t in body.get("tools") or []
            if isinstance(t, dict)
        }
        tool_calls = []
        if step.tool and step.tool in offered:
            tool_calls = [
                {
                    "id": f"call_{uuid.uuid4().hex[:12]}",
                    "type": "function",
                    "function": {"name": step.tool, "arguments": json.dumps(step.arguments)},
                }
            ]
        finish = "tool_calls" if tool_calls else "stop"
        prompt_tokens = sum(_estimate_tokens(_content_text(m.get("content"))) for m in messages)
        completion_tokens = _estimate_tokens(step.thought + json.dumps(step.arguments))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = str(body.get("model") or self.policy.script.model)
        if body.get("stream"):
            return await self._stream(
                request=request,
                completion_id=completion_id,
                created=created,
                model=model,
                content=step.thought,
                tool_calls=tool_calls,
                finish=finish,
                usage=usage,
            )
        message: dict[str, Any] = {"role": "assistant", "content": step.thought}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return web.json_response(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage,
            }
        )

    async def _stream(
        self,
        *,
        request: web.Request,
        completion_id: str,
        created: int,
        model: str,
        content: str,
        tool_calls: list[dict[str, Any]],
        finish: str,
        usage: dict[str, int],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(delta: dict[str, Any], finish_reason: str | None, **extra: Any) -> None:
            chunk = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
                **extra,
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await send({"role": "assistant", "content": content}, None)
        if tool_calls:
            await send({"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]}, None)
        await send({}, finish, usage=usage)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def serve_forever(server: ScriptedPolicyServer) -> None:
    async with server:
        await asyncio.Event().wait()
