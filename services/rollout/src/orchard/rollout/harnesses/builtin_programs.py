"""The built-in definitions of third-party agent programs run in sandboxes.

Each is `SandboxedProgramHarness` settings: the headless command, the environment and the
configuration files that point the program at the rollout's model endpoint and keep it from
reaching anything else (update checks, telemetry, plugin stores). Versions come from the harness
cache's manifest (``tools/harnesses.py`` pins them).

=================  ==================  ==========================================================
harness            dialect             headless mode
=================  ==================  ==========================================================
program:openclaw   chat completions    ``openclaw agent exec --config F --model local/M --json``
program:claude-code anthropic messages ``claude -p TASK --output-format json`` (root: IS_SANDBOX)
program:codex      responses           ``codex exec --json``, ``$CODEX_HOME/config.toml``
program:hermes     chat completions    ``hermes -z TASK``, ``$HERMES_HOME/config.yaml``
=================  ==================  ==========================================================

A task's MCP servers (`TaskSpec.mcp_servers`) reach Claude Code (``--mcp-config`` JSON,
``--strict-mcp-config``, and its tool search off so the tools are offered like its own); Codex,
OpenClaw and hermes work through their shell, where the same tools are commands.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence

from orchard.rollout.harnesses.sandboxed import (
    MCP_ARGS,
    HarnessCache,
    ProgramFile,
    SandboxedProgramHarness,
)
from orchard.tasks.spec import McpServer

__all__ = ["BUILTIN_PROGRAMS", "builtin_program_harnesses", "program_harness"]

OPENCLAW_CONFIG = """\
{
  "models": {
    "providers": {
      "local": {
        "baseUrl": "{base_url}",
        "apiKey": "{api_key}",
        "api": "openai-completions",
        "models": [
          {"id": "{model}", "name": "{model}", "contextWindow": 131072, "maxTokens": {max_tokens}}
        ]
      }
    }
  },
  "agents": {"defaults": {"model": {"primary": "local/{model}"}}}
}
"""

CODEX_CONFIG = """\
model = "{model}"
model_provider = "local"

[model_providers.local]
name = "local"
base_url = "{base_url}"
env_key = "LOCAL_API_KEY"
wire_api = "responses"
"""

HERMES_CONFIG = """\
model:
  provider: custom
  default: "{model}"
  base_url: "{base_url}"
  api_key: "{api_key}"
"""


OPENCLAW_COMMAND = (
    "openclaw", "agent", "exec",
    "--config", "{home}/.openclaw-orchard.json",
    "--model", "local/{model}",
    "--cwd", "{workdir}",
    "--json",
    "{instruction}",
)  # fmt: skip

CLAUDE_COMMAND = (
    "claude", "-p", "{instruction}",
    "--dangerously-skip-permissions",
    "--model", "{model}",
    "--output-format", "json",
    MCP_ARGS,
)  # fmt: skip


def claude_mcp_args(servers: Sequence[McpServer]) -> tuple[str, ...]:
    """Claude Code's MCP settings: the servers as one JSON config, and no others (its user and
    project settings are not read)."""
    config = {
        "mcpServers": {
            s.name: {"type": "stdio", "command": s.command[0], "args": list(s.command[1:])}
            for s in servers
        }
    }
    # --mcp-config takes several values: the next option ends them.
    return ("--mcp-config", json.dumps(config), "--strict-mcp-config")


CODEX_COMMAND = (
    "codex", "exec",
    "--skip-git-repo-check",
    "--dangerously-bypass-approvals-and-sandbox",
    # Each of these otherwise reaches for an outside host.
    "--disable", "plugins",
    "--disable", "remote_plugin",
    "--disable", "apps",
    "--disable", "in_app_updates",
    "-c", "analytics.enabled=false",
    "--cd", "{workdir}",
    "--json",
    "{instruction}",
)  # fmt: skip


def _definitions(cache: HarnessCache) -> dict[str, SandboxedProgramHarness]:
    return {
        "program:openclaw": SandboxedProgramHarness(
            name="program:openclaw",
            program="openclaw",
            cache=cache,
            dialect="chat_completions",
            command=OPENCLAW_COMMAND,
            files=(ProgramFile("{home}/.openclaw-orchard.json", OPENCLAW_CONFIG),),
            description="OpenClaw (unmodified) in the task's sandbox; OpenAI chat completions.",
        ),
        "program:claude-code": SandboxedProgramHarness(
            name="program:claude-code",
            program="claude",
            cache=cache,
            dialect="anthropic_messages",
            command=CLAUDE_COMMAND,
            mcp_args=claude_mcp_args,
            # Its tool search would defer the MCP tools behind a `ToolSearch` call; a policy
            # trained here sees them offered as any other tool.
            mcp_env={"ENABLE_TOOL_SEARCH": "false"},
            env={
                "ANTHROPIC_BASE_URL": "{anthropic_base_url}",
                "ANTHROPIC_API_KEY": "{api_key}",
                # As root it refuses --dangerously-skip-permissions outside a sandbox it knows.
                "IS_SANDBOX": "1",
                # Otherwise it probes the vendor's hosts and resolves outside names.
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "DISABLE_AUTOUPDATER": "1",
            },
            description="Claude Code (unmodified) in the task's sandbox; Anthropic Messages.",
        ),
        "program:codex": SandboxedProgramHarness(
            name="program:codex",
            program="codex",
            cache=cache,
            dialect="responses",
            command=CODEX_COMMAND,
            env={"CODEX_HOME": "{home}/.codex", "LOCAL_API_KEY": "{api_key}"},
            files=(ProgramFile("{home}/.codex/config.toml", CODEX_CONFIG),),
            description="Codex CLI (unmodified) in the task's sandbox; OpenAI Responses.",
        ),
        "program:hermes": SandboxedProgramHarness(
            name="program:hermes",
            program="hermes",
            cache=cache,
            dialect="chat_completions",
            command=("hermes", "-z", "{instruction}"),
            env={"HERMES_HOME": "{home}/.hermes"},
            files=(ProgramFile("{home}/.hermes/config.yaml", HERMES_CONFIG),),
            description="hermes-agent (unmodified) in the task's sandbox; OpenAI chat completions.",
        ),
    }


BUILTIN_PROGRAMS = tuple(_definitions(HarnessCache("")))
"""The names of the built-in program harnesses."""


def program_harness(
    name: str, cache: HarnessCache, *, wall_clock_s: float = 600.0
) -> SandboxedProgramHarness:
    """The built-in harness `name` (one of `BUILTIN_PROGRAMS`) running from `cache`."""
    return dataclasses.replace(_definitions(cache)[name], wall_clock_s=wall_clock_s)


def builtin_program_harnesses(
    cache: HarnessCache, names: Iterable[str] = BUILTIN_PROGRAMS, *, wall_clock_s: float = 600.0
) -> dict[str, SandboxedProgramHarness]:
    return {name: program_harness(name, cache, wall_clock_s=wall_clock_s) for name in names}
