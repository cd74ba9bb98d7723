"""The generic OpenAI tool-calling loop: the base of every built-in harness.

Each step sends the conversation and the tool schemas to an OpenAI-compatible endpoint with the
official `openai` client, executes the tool calls of the reply in the sandbox and appends their
outputs. It ends when the model calls a submitting tool or answers without a tool call
(completed), or a step or token budget runs out (truncated). The caller bounds the wall clock.

Bad tool calls (unknown tool, arguments that are not a JSON object, a tool error the model
caused) are observations for the model: policy outcomes. Endpoint and sandbox failures are
retried per layer and then raised as `InfrastructureError`.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import openai

from orchard.rollout.budgets import InfrastructureError, LayeredRetries, RolloutBudget, with_retries
from orchard.rollout.harnesses.episodes import BrowserRun
from orchard.rollout.harnesses.tools import (
    INFRASTRUCTURE_ERRORS,
    POLICY_ERRORS,
    BashTool,
    Tool,
    ToolOutput,
    tools_by_name,
)
from orchard.rollout.provenance import FailureLayer, RolloutRecord, ToolEvent
from orchard.sdk import AsyncSandbox
from orchard.tasks.spec import McpServer

RETRYABLE_INFERENCE_ERRORS: tuple[type[Exception], ...] = (
    openai.APIConnectionError,  # APITimeoutError is a subclass
    openai.InternalServerError,
    openai.RateLimitError,
)


@dataclass(frozen=True, slots=True)
class ModelEndpoint:
    """Where the harness's model calls go: the capture proxy, or any OpenAI-compatible server."""

    base_url: str
    """May contain "{rollout_id}", replaced per rollout (a capture session in the URL)."""
    model: str
    api_key: str = "orchard"
    temperature: float = 1.0
    max_tokens_per_call: int = 1024

    def for_rollout(self, rollout_id: str) -> str:
        return self.base_url.replace("{rollout_id}", rollout_id)


@dataclass(frozen=True, slots=True)
class HarnessOutcome:
    outcome: str
    """"submitted", "stopped" (answered without a tool call), "step_limit" or "token_limit"."""
    truncated: bool


@dataclass(frozen=True, slots=True)
class HarnessContext:
    """What one run of a harness gets."""

    rollout_id: str
    instruction: str
    sandbox: AsyncSandbox
    client: openai.AsyncOpenAI
    endpoint: ModelEndpoint
    budget: RolloutBudget
    retries: LayeredRetries
    record: RolloutRecord
    rng: random.Random
    tools: Sequence[Tool] = ()
    """Tools the task declares (the generic loop offers them beside the harness's own)."""
    mcp_servers: Sequence[McpServer] = ()
    """MCP servers the task's sandbox can run (agent programs with MCP support start them)."""
    browser: BrowserRun | None = None
    """A GUI task's browser episode (`sandbox` is its browser sandbox), which a browser harness
    drives and fills with what its scoring needs."""


@dataclass(frozen=True, slots=True)
class ToolCallingHarness:
    """The loop; `name` is how tasks and runs refer to it (e.g. "builtin:bash")."""

    name: str
    system_prompt: str
    tools: tuple[Tool, ...] = ()
    observation_limit: int = 8000
    """Most characters of one tool output the model is shown."""
    description: str = ""
    """One line for a person (what ListHarnesses says about it)."""

    def in_directory(self, workdir: str) -> ToolCallingHarness:
        """This harness with its shell running in `workdir` (a task's), unless its shell has
        a directory of its own; itself when `workdir` is empty."""
        if not workdir:
            return self
        tools = tuple(
            dataclasses.replace(tool, cwd=workdir)
            if isinstance(tool, BashTool) and not tool.cwd
            else tool
            for tool in self.tools
        )
        return dataclasses.replace(self, tools=tools)

    async def run(self, ctx: HarnessContext) -> HarnessOutcome:
        table = tools_by_name([*self.tools, *ctx.tools])
        schemas = [tool.schema() for tool in table.values()]
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": ctx.instruction},
        ]
        ctx.record.messages = messages
        ctx.record.messages_complete = True
        while True:
            if ctx.record.steps >= ctx.budget.max_steps:
                return HarnessOutcome("step_limit", truncated=True)
            if ctx.record.sampled_tokens >= ctx.budget.max_tokens:
                return HarnessOutcome("token_limit", truncated=True)
            assistant = await next_turn(ctx, messages, schemas)
            messages.append(assistant)
            if "tool_calls" not in assistant:
                return HarnessOutcome("stopped", truncated=False)
            submitted = False
            for call in assistant.get("tool_calls", []):
                output = await self._run_tool(ctx, table, call)
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": output.text}
                )
                submitted = submitted or output.submitted
            if submitted:
                return HarnessOutcome("submitted", truncated=False)

    async def _run_tool(
        self, ctx: HarnessContext, table: dict[str, Tool], call: dict[str, Any]
    ) -> ToolOutput:
        name = call["function"]["name"]
        started = time.time()
        arguments: dict[str, Any] = {}
        tool = table.get(name)
        if tool is None:
            output = ToolOutput(f"unknown tool {name!r}; the tools are {', '.join(sorted(table))}")
        else:
            try:
                parsed = json.loads(call["function"]["arguments"] or "{}")
                if not isinstance(parsed, dict):
                    raise ValueError("the arguments must be a JSON object")
                arguments = parsed
            except ValueError as exc:
                output = ToolOutput(f"bad arguments for {name}: {exc}")
            else:
                output = await self._execute(ctx, tool, arguments)
        shown = output.text
        if len(shown) > self.observation_limit:
            shown = (
                shown[: self.observation_limit]
                + f"\n[{len(output.text) - self.observation_limit} more characters cut]"
            )
        ctx.record.tool_events.append(
            ToolEvent(
                started_at=started,
                latency_s=time.time() - started,
                sandbox_id=ctx.sandbox.id,
                tool=name,
                arguments=arguments,
                exit_code=output.exit_code,
                output=shown,
                call_id=str(call.get("id", "")),
            )
        )
        return ToolOutput(shown, output.exit_code, output.submitted)

    async def _execute(
        self, ctx: HarnessContext, tool: Tool, arguments: dict[str, Any]
    ) -> ToolOutput:
        async def attempt(_: int) -> ToolOutput:
            try:
                return await tool.run(ctx.sandbox, arguments)
            except INFRASTRUCTURE_ERRORS:
                raise
            except POLICY_ERRORS as exc:
                return ToolOutput(f"error: {exc}", None)
            except (ValueError, TypeError, UnicodeDecodeError) as exc:
                return ToolOutput(f"error: {exc}", None)

        # A command may have run when its sandbox stopped answering: only idempotent-looking
        # failures (the agent unreachable) are retried, as the layer's policy says.
        return await with_retries(
            FailureLayer.TOOL_EXEC,
            ctx.retries.tool_exec,
            attempt,
            retryable=INFRASTRUCTURE_ERRORS,
            rng=ctx.rng,
        )


async def next_turn(
    ctx: HarnessContext, messages: list[dict[str, Any]], schemas: list[dict[str, Any]]
) -> dict[str, Any]:
    """Asks the model for its next turn (retried per the inference layer's policy), counts the
    step and its tokens in the record, and returns the turn as an assistant message (with
    "tool_calls" only when it called a tool)."""
    reply = await _complete(ctx, messages, schemas)
    ctx.record.steps += 1
    choice = reply.choices[0]
    usage = reply.usage
    ctx.record.sampled_tokens += (
        usage.completion_tokens if usage is not None else len(choice.message.content or "") // 4 + 1
    )
    tool_calls = list(choice.message.tool_calls or [])
    assistant: dict[str, Any] = {"role": "assistant", "content": choice.message.content or ""}
    if tool_calls:
        assistant["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in tool_calls
            if call.type == "function"
        ]
    return assistant


async def _complete(
    ctx: HarnessContext, messages: list[dict[str, Any]], schemas: list[dict[str, Any]]
) -> Any:
    remaining = ctx.budget.max_tokens - ctx.record.sampled_tokens
    kwargs: dict[str, Any] = {
        "model": ctx.endpoint.model,
        "messages": messages,
        "temperature": ctx.endpoint.temperature,
        "max_tokens": max(1, min(ctx.endpoint.max_tokens_per_call, remaining)),
    }
    if schemas:
        kwargs["tools"] = schemas

    async def attempt(_: int) -> Any:
        try:
            return await ctx.client.chat.completions.create(**kwargs)
        except openai.BadRequestError as exc:
            # The endpoint refused the request itself; repeating it cannot help.
            raise InfrastructureError(FailureLayer.INFERENCE, f"request refused: {exc}", 1) from exc

    return await with_retries(
        FailureLayer.INFERENCE,
        ctx.retries.inference,
        attempt,
        retryable=RETRYABLE_INFERENCE_ERRORS,
        rng=ctx.rng,
    )
