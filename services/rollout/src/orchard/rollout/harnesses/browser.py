"""The browser harness of the GUI domain: a ReAct tool-calling loop over the 13 atomic tools.

Each step sends the conversation and the tools (OpenAI function format,
`orchard.tasks.gui.actions`) to the model, runs the first tool call of its reply in the
episode's browser sandbox and shows what the browser returned. The conversation starts with the
task's intent and the page it starts on; after every action comes an observation: the result,
the tabs, and the page as the model perceives it, either

- ``screenshot``: the screenshot as an image (a vision-language model), or
- ``page_text``: the page as text, its elements with the centres a click hits (a text model,
  and the scripted teacher).

Only the last ``keep_last`` screenshots (or page texts) stay in the conversation; earlier ones
become a one-line placeholder while the model's own turns stay whole. One action per turn: further
calls in a turn are answered as not run. A turn that does not parse (no tool call, an unknown
tool, arguments that break the tool's schema) is a format failure: the model is told what to fix,
and the episode ends once ``format_failure_limit`` of them have happened. The episode ends when
the model calls ``done`` (submitted), or the step or token budget runs out (truncated).

A browser that stops answering is an infrastructure failure (the rollout is excluded), never
the policy's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from orchard.rollout.budgets import InfrastructureError
from orchard.rollout.harnesses.episodes import BrowserRun, BrowserStep
from orchard.rollout.harnesses.tool_loop import HarnessContext, HarnessOutcome, next_turn
from orchard.rollout.provenance import FailureLayer, ToolEvent
from orchard.tasks.gui.actions import TOOLS, ToolArgumentError, ToolSpec, validate_arguments
from orchard.tasks.gui.episode import BrowserSandboxSettings, BrowserUnavailable
from orchard.tasks.gui.observation import Observation

if TYPE_CHECKING:
    from orchard.rollout.config import GuiConfig

__all__ = [
    "OBSERVATION_KINDS",
    "BrowserHarness",
    "BrowserTool",
    "ObservationKind",
    "browser_harnesses",
]

ObservationKind = Literal["screenshot", "page_text"]
OBSERVATION_KINDS: tuple[ObservationKind, ...] = ("screenshot", "page_text")

SYSTEM_PROMPT = """\
You operate a web browser to do a task for a person. After each action you see the result of
the action, the open tabs and the page{perception}. Coordinates are viewport pixels of the
latest page, measured from its top left corner. Think briefly, then call exactly one tool per
turn. When the task is complete, call `done` with your answer: the information the task asks
for, or a short confirmation of what you did."""

PERCEPTION = {
    "screenshot": " as a screenshot",
    "page_text": " as text: every element with its role, name, value and the centre point a click "
    "at it hits",
}
NO_TOOL_CALL = (
    "Your reply called no tool. Act with exactly one tool call; call `done` with your answer "
    "when the task is complete."
)
EXTRA_CALL = "not run: one action per turn; look at the result of the first call, then act again"


@dataclass(frozen=True, slots=True)
class BrowserTool:
    """One of the 13 tools as ListHarnesses shows it."""

    spec: ToolSpec

    def schema(self) -> dict[str, Any]:
        return self.spec.openai_schema()


@dataclass(frozen=True, slots=True)
class BrowserHarness:
    """The loop; `name` is how tasks and runs refer to it (e.g. "builtin:browser")."""

    name: str
    settings: BrowserSandboxSettings
    """How the runner opens the episode's sandboxes."""
    observation: ObservationKind = "screenshot"
    keep_last: int = 3
    """Screenshots (or page texts) kept in the conversation; earlier ones become placeholders."""
    format_failure_limit: int = 3
    """Format failures that end the episode (the reward service scores such an episode -1)."""
    description: str = ""
    tools: tuple[BrowserTool, ...] = field(
        default_factory=lambda: tuple(BrowserTool(spec) for spec in TOOLS.values())
    )

    def __post_init__(self) -> None:
        if self.observation not in OBSERVATION_KINDS:
            raise ValueError(
                f"observation must be one of {', '.join(OBSERVATION_KINDS)}, "
                f"got {self.observation!r}"
            )
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {self.keep_last}")
        if self.format_failure_limit < 1:
            raise ValueError(
                f"format_failure_limit must be at least 1, got {self.format_failure_limit}"
            )

    @property
    def system_prompt(self) -> str:
        return SYSTEM_PROMPT.format(perception=PERCEPTION[self.observation])

    def in_directory(self, workdir: str) -> BrowserHarness:
        """Itself: a browser has no working directory."""
        return self

    async def run(self, ctx: HarnessContext) -> HarnessOutcome:
        run = ctx.browser
        if run is None:
            raise InfrastructureError(
                FailureLayer.HARNESS,
                f"{self.name} drives a browser episode: run it on GUI tasks "
                '(scorer_json "gui"), not on a task with one sandbox',
                1,
            )
        schemas = [tool.schema() for tool in self.tools]
        conversation = _Conversation(self, ctx.instruction)
        ctx.record.messages = conversation.messages
        ctx.record.messages_complete = True
        first = await self._act(ctx, run, "goto_url", {"url": run.start_url}, call_id="")
        conversation.observe(first, tool_call_id=None)
        while True:
            if ctx.record.steps >= ctx.budget.max_steps:
                return HarnessOutcome("step_limit", truncated=True)
            if ctx.record.sampled_tokens >= ctx.budget.max_tokens:
                return HarnessOutcome("token_limit", truncated=True)
            assistant = await next_turn(ctx, conversation.messages, schemas)
            conversation.messages.append(assistant)
            calls = assistant.get("tool_calls") or []
            if not calls:
                conversation.messages.append({"role": "user", "content": NO_TOOL_CALL})
                run.format_failures += 1
            else:
                for extra in calls[1:]:
                    conversation.messages.append(
                        {"role": "tool", "tool_call_id": extra["id"], "content": EXTRA_CALL}
                    )
                first_call = calls[0]
                name = first_call["function"]["name"]
                try:
                    arguments = _arguments(name, first_call["function"]["arguments"])
                except ToolArgumentError as exc:
                    conversation.refuse(first_call["id"], str(exc))
                    run.format_failures += 1
                else:
                    observation = await self._act(
                        ctx, run, name, arguments, call_id=first_call["id"]
                    )
                    conversation.observe(observation, tool_call_id=first_call["id"])
                    if observation.done:
                        run.response = observation.response
                        return HarnessOutcome("submitted", truncated=False)
            if run.format_failures >= self.format_failure_limit:
                return HarnessOutcome("format_failures", truncated=False)

    async def _act(
        self,
        ctx: HarnessContext,
        run: BrowserRun,
        tool: str,
        arguments: dict[str, Any],
        *,
        call_id: str,
    ) -> Observation:
        started = time.time()
        try:
            observation = await run.episode.call(tool, arguments)
        except BrowserUnavailable as exc:
            raise InfrastructureError(FailureLayer.TOOL_EXEC, str(exc), 1) from None
        if observation.screenshot is not None:
            run.screenshots.append(observation.screenshot)
        seen = _without_page(observation)
        run.steps.append(BrowserStep(tool, arguments, seen))
        ctx.record.tool_events.append(
            ToolEvent(
                started_at=started,
                latency_s=time.time() - started,
                sandbox_id=run.episode.browser.id,
                tool=tool,
                arguments=arguments,
                exit_code=0 if observation.ok else 1,
                output=seen.summary(),
                call_id=call_id,
            )
        )
        return observation


def _arguments(name: str, raw: str) -> dict[str, Any]:
    """A call's checked arguments; `ToolArgumentError` saying what to fix."""
    if name not in TOOLS:
        raise ToolArgumentError(f"no tool {name!r}; the tools are {', '.join(TOOLS)}")
    try:
        parsed = json.loads(raw or "{}")
    except ValueError as exc:
        raise ToolArgumentError(f"the arguments of {name} are not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ToolArgumentError(f"the arguments of {name} must be a JSON object")
    return validate_arguments(name, parsed)


def _without_page(observation: Observation) -> Observation:
    return Observation(
        tool=observation.tool,
        ok=observation.ok,
        message=observation.message,
        screenshot=observation.screenshot,
        viewport=observation.viewport,
        tabs=observation.tabs,
        error=observation.error,
        events=observation.events,
        dialogs=observation.dialogs,
        done=observation.done,
        response=observation.response,
        elapsed_s=observation.elapsed_s,
        page_text=None,
    )


class _Conversation:
    """The messages the model sees, with only the last `keep_last` pages shown whole."""

    def __init__(self, harness: BrowserHarness, instruction: str) -> None:
        self.kind = harness.observation
        self.keep_last = harness.keep_last
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": harness.system_prompt},
            {"role": "user", "content": instruction},
        ]
        self._pages: list[tuple[int, Any]] = []
        """(message index, the content that replaces it once it is no longer among the last)"""

    def observe(self, observation: Observation, *, tool_call_id: str | None) -> None:
        """Appends an observation: a tool message (or, for the first page, a user message),
        and in screenshot mode a user message with the image."""
        brief = _without_page(observation).summary()
        if self.kind == "page_text":
            text = observation.summary()
            if observation.page_text is None:
                text += "\n(the page could not be read as text this time)"
            self._append(text, tool_call_id)
            short = brief + f"\npage text: [omitted: only the last {self.keep_last} are kept]"
            self._pages.append((len(self.messages) - 1, short))
        else:
            self._append(brief, tool_call_id)
            encoded = observation.screenshot_base64()
            if encoded is not None:
                self.messages.append(
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": f"Screenshot after {observation.tool}:"},
                            {
                                "type": "image_url",
                                "image_url": {"url": f"data:image/png;base64,{encoded}"},
                            },
                        ],
                    }
                )
                short = (
                    f"Screenshot after {observation.tool}: [omitted: only the last "
                    f"{self.keep_last} are kept]"
                )
                self._pages.append((len(self.messages) - 1, short))
        for index, short in self._pages[: -self.keep_last]:
            self.messages[index]["content"] = short

    def refuse(self, tool_call_id: str, why: str) -> None:
        self.messages.append(
            {"role": "tool", "tool_call_id": tool_call_id, "content": f"not run: {why}"}
        )

    def _append(self, text: str, tool_call_id: str | None) -> None:
        if tool_call_id is None:
            self.messages.append({"role": "user", "content": text})
        else:
            self.messages.append({"role": "tool", "tool_call_id": tool_call_id, "content": text})


def browser_harnesses(config: GuiConfig) -> dict[str, BrowserHarness]:
    """The built-in browser harnesses, none without a browser folder: ``builtin:browser``
    (screenshots, for vision-language models) and ``builtin:browser-text`` (page text, for text
    models and the scripted teacher)."""
    browser_dir = config.resolved_browser_dir()
    if not browser_dir:
        return {}
    settings = BrowserSandboxSettings(
        browser_dir=browser_dir,
        image=config.image,
        site_image=config.site_image,
        site_port=config.site_port,
        chromium=config.chromium,
        browser_user=config.browser_user,
        chromium_sandbox=config.chromium_sandbox,
        viewport=config.viewport,
        action_timeout_s=config.action_timeout_s,
    )
    made = (
        BrowserHarness(
            name="builtin:browser",
            settings=settings,
            observation="screenshot",
            keep_last=config.keep_last,
            format_failure_limit=config.format_failure_limit,
            description="The GUI loop over the 13 browser tools, seeing screenshots "
            "(vision-language models).",
        ),
        BrowserHarness(
            name="builtin:browser-text",
            settings=settings,
            observation="page_text",
            keep_last=config.keep_last,
            format_failure_limit=config.format_failure_limit,
            description="The GUI loop over the 13 browser tools, seeing each page as text "
            "(text models, the scripted GUI teacher).",
        ),
    )
    return {harness.name: harness for harness in made}
