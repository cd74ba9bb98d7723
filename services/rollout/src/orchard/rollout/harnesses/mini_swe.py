"""A black-box harness: mini-swe-agent (the PyPI package, unmodified) beside the sandbox.

The agent's model is its own litellm model class pointed at an OpenAI-compatible endpoint (the
capture proxy, one session per rollout in the URL), so every call it makes is captured with exact
tokens. Its execution backend is `SandboxEnvironment`, an adapter of mini-swe-agent's
environment protocol (``execute(action) -> {"output", "returncode", "exception_info"}``) onto an
Orchard sandbox through the environment service: each command runs there as ``/bin/sh -c``.

mini-swe-agent is synchronous. The harness runs the agent in a worker thread; the environment
hands each command to the event loop that owns the sandbox client and waits for its result.
Install the ``mini-swe-agent`` extra of orchard-rollout; the package is imported only when a
rollout runs this harness.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from orchard.rollout.budgets import InfrastructureError
from orchard.rollout.harnesses.tool_loop import HarnessContext, HarnessOutcome
from orchard.rollout.harnesses.tools import INFRASTRUCTURE_ERRORS
from orchard.rollout.provenance import FailureLayer, RolloutRecord, ToolEvent
from orchard.sdk import AsyncSandbox

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""mini-swe-agent's convention: a command whose output starts with this line submits the rest."""

_OUTCOMES: Mapping[str, tuple[str, bool]] = {
    "Submitted": ("submitted", False),
    "LimitsExceeded": ("step_limit", True),
    "TimeExceeded": ("time_limit", True),
    "RepeatedFormatError": ("format_errors", False),
}
"""mini-swe-agent exit statuses → (outcome, truncated)."""


def _import_minisweagent() -> tuple[Any, ...]:
    # The package prints a banner and litellm fetches a price list at import unless told not to.
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        return tuple(
            importlib.import_module(f"minisweagent.{name}")
            for name in ("agents.default", "config", "exceptions", "models.litellm_model")
        )
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise RuntimeError(
            "the mini-swe-agent harness needs the package: "
            "pip install 'orchard-rollout[mini-swe-agent]'"
        ) from exc


class SandboxEnvironment:
    """mini-swe-agent's environment protocol on an Orchard sandbox (see the module docstring).

    Called from the agent's thread; `loop` is the event loop the sandbox client lives on. Each
    command is recorded as a `ToolEvent` ("bash") in `record`.
    """

    def __init__(
        self,
        sandbox: AsyncSandbox,
        loop: asyncio.AbstractEventLoop,
        record: RolloutRecord,
        *,
        timeout_s: float = 60.0,
        output_limit: int = 16_384,
        cwd: str = "",
        submitted: type[Exception] | None = None,
    ) -> None:
        self.sandbox = sandbox
        self.timeout_s = timeout_s
        self.output_limit = output_limit
        self.cwd = cwd
        self.config = {"timeout_s": timeout_s, "output_limit": output_limit, "cwd": cwd}
        """What mini-swe-agent shows of the environment (template variables, trajectories)."""
        self._loop = loop
        self._record = record
        self._submitted = submitted
        self.cancelled = threading.Event()
        """Set when the rollout is cancelled: the next command raises instead of running."""

    def execute(
        self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        if self.cancelled.is_set():
            raise InfrastructureError(FailureLayer.CANCELLED, "the rollout was cancelled", 1)
        command = str(action.get("command", ""))
        started = time.time()
        coroutine = self.sandbox.exec(
            ["/bin/sh", "-c", command],
            timeout=float(timeout or self.timeout_s),
            output_limit=self.output_limit,
            cwd=(cwd or self.cwd) or None,
        )
        result = asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()
        text = result.stdout_text + result.stderr_text
        output: dict[str, Any] = {
            "output": text,
            "returncode": result.exit_code if result.exit_code is not None else -1,
            "exception_info": "the command timed out" if result.timed_out else "",
        }
        self._record.tool_events.append(
            ToolEvent(
                started_at=started,
                latency_s=time.time() - started,
                sandbox_id=self.sandbox.id,
                tool="bash",
                arguments={"command": command},
                exit_code=result.exit_code,
                output=text,
                call_id=str(action.get("tool_call_id", "")),
            )
        )
        lines = text.lstrip().splitlines(keepends=True)
        if (
            self._submitted is not None
            and lines
            and lines[0].strip() == SUBMIT_MARKER
            and result.exit_code == 0
        ):
            submission = "".join(lines[1:])
            raise self._submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.config, "sandbox_id": self.sandbox.id, **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": dict(self.config, sandbox_id=self.sandbox.id),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                }
            }
        }


@dataclass(frozen=True, slots=True)
class MiniSweAgentHarness:
    """mini-swe-agent's `DefaultAgent` with its litellm model and `SandboxEnvironment`.

    Without templates it uses the package's own tool-calling configuration (``mini.yaml``).
    The step budget is the rollout's `max_steps`; cost tracking is off (the endpoint is ours).
    """

    name: str = "mini-swe-agent"
    system_template: str | None = None
    instance_template: str | None = None
    command_timeout_s: float = 60.0
    cwd: str = ""
    agent_settings: Mapping[str, Any] = field(default_factory=dict)
    """More `AgentConfig` fields of mini-swe-agent (they win over the defaults above)."""

    async def run(self, ctx: HarnessContext) -> HarnessOutcome:
        agents, configs, exceptions, models = _import_minisweagent()
        builtin = _builtin_config(configs)
        model = models.LitellmModel(
            model_name=f"openai/{ctx.endpoint.model}",
            model_kwargs={
                "api_base": ctx.endpoint.for_rollout(ctx.rollout_id),
                "api_key": ctx.endpoint.api_key,
                "temperature": ctx.endpoint.temperature,
                "max_tokens": ctx.endpoint.max_tokens_per_call,
            },
            cost_tracking="ignore_errors",
            **builtin.get("model", {}),
        )
        environment = SandboxEnvironment(
            ctx.sandbox,
            asyncio.get_running_loop(),
            ctx.record,
            timeout_s=self.command_timeout_s,
            cwd=self.cwd,
            submitted=exceptions.Submitted,
        )
        agent_config: dict[str, Any] = {
            "system_template": self.system_template or builtin["agent"]["system_template"],
            "instance_template": self.instance_template or builtin["agent"]["instance_template"],
            "step_limit": ctx.budget.max_steps,
            "cost_limit": 0,
            **self.agent_settings,
        }
        agent = agents.DefaultAgent(model, environment, **agent_config)
        try:
            result = await asyncio.to_thread(agent.run, ctx.instruction)
        except asyncio.CancelledError:
            environment.cancelled.set()
            raise
        except InfrastructureError:
            raise
        except INFRASTRUCTURE_ERRORS as exc:
            raise InfrastructureError(
                FailureLayer.TOOL_EXEC, f"{type(exc).__name__}: {exc}", 1
            ) from exc
        except Exception as exc:
            # mini-swe-agent raises what its model raised once its own retries gave up.
            raise InfrastructureError(
                FailureLayer.INFERENCE, f"{type(exc).__name__}: {exc}", 1
            ) from exc
        finally:
            ctx.record.steps = agent.n_calls
            ctx.record.messages = [
                {k: v for k, v in message.items() if k != "extra"} for message in agent.messages
            ]
            ctx.record.messages_complete = True
            ctx.record.sampled_tokens = sum(_completion_tokens(m) for m in agent.messages)
        status = str(result.get("exit_status", ""))
        outcome, truncated = _OUTCOMES.get(status, (status or "stopped", False))
        return HarnessOutcome(outcome, truncated=truncated)


def _builtin_config(configs: Any) -> dict[str, Any]:
    data = yaml.safe_load(configs.get_config_path("mini").read_text())
    wanted = {"system_template", "instance_template"}
    agent = {k: v for k, v in data.get("agent", {}).items() if k in wanted}
    model = {
        k: v
        for k, v in data.get("model", {}).items()
        if k in {"observation_template", "format_error_template"}
    }
    return {"agent": agent, "model": model}


def _completion_tokens(message: Mapping[str, Any]) -> int:
    response = message.get("extra", {}).get("response")
    if not isinstance(response, Mapping):
        return 0
    usage = response.get("usage") or {}
    return int(usage.get("completion_tokens") or 0)
