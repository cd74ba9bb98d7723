"""A harness kind for unmodified agent programs that run *inside* the task's sandbox.

The program (OpenClaw, Claude Code, Codex, hermes-agent, or any command) comes from the
offline harness cache that ``tools/harnesses.py`` builds (``make harnesses``): one folder with a
``manifest.json`` (name → version, entry point) and ``bin/`` on the program's PATH. The local
runtime's ``host`` image shows the host root read-only in every sandbox, so the cache is visible
there at the same path; other images need it mounted there.

Per rollout the harness

1. allows the sandbox to reach the rollout's model endpoint (the capture proxy's session URL):
   one egress rule, TCP to that host and port only, expiring with the wall-clock budget. A
   sandbox reaches a host address through its link's default route, so the proxy must listen on
   an address of the host other than loopback (``proxy.host``); a loopback endpoint is refused
   with that advice, since a sandbox's own loopback is its own;
2. writes the program's configuration files into the sandbox (placeholders below filled in);
3. runs the command in the sandbox with a fresh ``$HOME`` and ``$TMPDIR`` there and only the
   environment it is given, under the wall-clock budget: past it the program's process group
   is killed and the rollout ends truncated ("time_limit");
4. records what the program printed (its JSON result) and its exit code as a `ToolEvent`
   named after the harness, and the instruction and final answer as `messages`.

Its model calls go through the capture proxy like any other harness's, so the runner's capture
source collects them with exact tokens. A non-zero exit is an infrastructure failure (layer
``harness``): these programs exit 0 when the model ends its turn, whether or not the task was
solved, so a non-zero status means the program or its endpoint broke. One exception, decided by
the runner once the calls settle: a program that gives up after the policy's last answer was cut
at its tokens per call (Claude Code and Codex exit 1 then) ended because of the policy, and the
rollout is scored as truncated (``token_limit``).

Placeholders, written ``{name}`` in commands, environment values and file contents (other braces,
e.g. JSON's, are left alone): ``instruction``, ``model``, ``workdir``, ``home``, ``cache`` (the
harness cache folder), ``base_url`` (OpenAI style, ending in ``/v1``), ``anthropic_base_url``
(the same without ``/v1``), ``api_key``, ``max_tokens`` (the endpoint's output budget per call).

MCP servers the task declares (`TaskSpec.mcp_servers`: stdio commands in the sandbox, such as the
Claw tools' ``claw-mcp``) reach a program that takes them through its ``mcp_args``: the command
element ``{mcp_args}`` becomes the arguments that configure them (Claude Code ``--mcp-config``),
or nothing when the task declares none. A program without
``mcp_args`` ignores them and works through its shell, where the same tools are commands.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from google.protobuf.timestamp_pb2 import Timestamp

from orchard.env.v1 import env_pb2, env_service_pb2
from orchard.rollout.budgets import InfrastructureError
from orchard.rollout.harnesses.tool_loop import HarnessContext, HarnessOutcome
from orchard.rollout.harnesses.tools import INFRASTRUCTURE_ERRORS
from orchard.rollout.provenance import FailureLayer, ToolEvent
from orchard.sdk import AsyncSandbox
from orchard.tasks.spec import McpServer

__all__ = [
    "MCP_ARGS",
    "Dialect",
    "HarnessCache",
    "McpArgs",
    "ProgramFile",
    "SandboxedProgramHarness",
    "fill",
    "host_address",
]

Dialect = Literal["chat_completions", "responses", "anthropic_messages"]
"""The model API a program speaks; the capture proxy serves each under the session URL."""

McpArgs = Callable[[Sequence[McpServer]], tuple[str, ...]]
"""How a program is told of MCP servers: the arguments that configure them."""
MCP_ARGS = "{mcp_args}"
"""The command element replaced by a program's `McpArgs` (none when the task has no servers)."""

MANIFEST = "manifest.json"
PLACEHOLDERS = (
    "instruction",
    "model",
    "workdir",
    "home",
    "cache",
    "base_url",
    "anthropic_base_url",
    "api_key",
    "max_tokens",
)
_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
_EGRESS_MARGIN_S = 60.0
"""How long past the program's budget its network allowance lasts (settling, slow exits)."""
_RESULT_CHARS = 256 * 1024
"""Most characters of the program's output kept in the record."""


def host_address() -> str:
    """This host's primary IPv4 address (the source of its default route): an address the
    local runtime's sandboxes reach through their links, and where the capture proxy can listen
    for them. No packet is sent; loopback when the host has no route at all."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routed by the default route only
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def fill(template: str, values: Mapping[str, str]) -> str:
    """`template` with each known ``{name}`` replaced; any other brace stays as it is."""
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)


@dataclass(frozen=True, slots=True)
class HarnessCache:
    """The folder ``tools/harnesses.py`` built: ``manifest.json`` and ``bin/``."""

    path: str

    def manifest(self) -> dict[str, Any]:
        """The manifest; raises `InfrastructureError` (layer harness) when it is missing."""
        file = Path(self.path) / MANIFEST
        try:
            data: dict[str, Any] = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise InfrastructureError(
                FailureLayer.HARNESS,
                f"no harness cache at {self.path} ({exc}): build it with `make harnesses` or "
                "set harnesses.cache_dir",
                1,
            ) from None
        return data

    def version(self, program: str) -> str:
        """The pinned version of `program`; raises when the cache lacks it."""
        entry = self.manifest().get("harnesses", {}).get(program)
        if not isinstance(entry, dict):
            raise InfrastructureError(
                FailureLayer.HARNESS,
                f"the harness cache at {self.path} has no {program!r}: run `make harnesses`",
                1,
            )
        return str(entry.get("version", ""))

    @property
    def bin_dir(self) -> str:
        return str(Path(self.path) / "bin")


@dataclass(frozen=True, slots=True)
class ProgramFile:
    """A file written into the sandbox before the program starts."""

    path: str
    """Absolute path in the sandbox; placeholders allowed (e.g. ``{home}/.codex/config.toml``)."""
    content: str
    """Placeholders filled in before writing."""
    mode: int = 0o600


@dataclass(frozen=True, slots=True)
class SandboxedProgramHarness:
    """An unmodified agent program run in the task's sandbox (see the module docstring)."""

    name: str
    """How tasks and jobs refer to it, e.g. ``program:openclaw``."""
    program: str
    """Its name in the harness cache's manifest (what ``bin/<program>`` runs)."""
    command: tuple[str, ...]
    """The argv; placeholders allowed."""
    cache: HarnessCache
    dialect: Dialect = "chat_completions"
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment variables of the program (PATH, HOME and TMPDIR are set already)."""
    files: tuple[ProgramFile, ...] = ()
    wall_clock_s: float = 600.0
    """Past this the program is killed and the rollout ends truncated."""
    home: str = "/home/orchard-agent"
    """$HOME in the sandbox (created fresh; the image's own home directories are not used)."""
    workdir: str = ""
    """Where the program works; empty: the task's working directory, else ``{home}/work``."""
    output_limit: int = 4 * 1024 * 1024
    """Most bytes of stdout and of stderr the sandbox returns."""
    description: str = ""
    system_prompt: str = ""
    """ListHarnesses shows this; the program brings its own prompt, unknown to us."""
    tools: tuple[Any, ...] = ()
    """None of ours: the program brings its own tools."""
    mcp_args: McpArgs | None = None
    """How the program takes the task's MCP servers (in place of the ``{mcp_args}`` command
    element); None: it does not, and the element (if any) is dropped."""
    mcp_env: Mapping[str, str] = field(default_factory=dict)
    """More environment of the program when it is given MCP servers."""

    def in_directory(self, workdir: str) -> SandboxedProgramHarness:
        """This harness working in `workdir` (a task's) unless it has a directory of its own."""
        if not workdir or self.workdir:
            return self
        return dataclasses.replace(self, workdir=workdir)

    def values(self, ctx: HarnessContext, base_url: str) -> dict[str, str]:
        home = self.home
        workdir = self.workdir or f"{home}/work"
        openai_url = base_url.rstrip("/")
        anthropic_url = openai_url.removesuffix("/v1")
        return {
            "instruction": ctx.instruction,
            "model": ctx.endpoint.model,
            "workdir": workdir,
            "home": home,
            "cache": self.cache.path,
            "base_url": openai_url,
            "anthropic_base_url": anthropic_url,
            "api_key": ctx.endpoint.api_key,
            "max_tokens": str(ctx.endpoint.max_tokens_per_call),
        }

    def argv(self, values: Mapping[str, str], mcp_servers: Sequence[McpServer]) -> list[str]:
        """The command with its placeholders filled and ``{mcp_args}`` spliced in."""
        argv: list[str] = []
        for part in self.command:
            if part != MCP_ARGS:
                argv.append(fill(part, values))
            elif mcp_servers and self.mcp_args is not None:
                argv.extend(self.mcp_args(mcp_servers))
        return argv

    async def run(self, ctx: HarnessContext) -> HarnessOutcome:
        self.cache.version(self.program)  # fails early, clearly, when the cache lacks it
        base_url = ctx.endpoint.for_rollout(ctx.rollout_id)
        if ctx.client.base_url is not None:
            base_url = str(ctx.client.base_url)  # the runner's: the capture session's URL
        values = self.values(ctx, base_url)
        budget = min(self.wall_clock_s, ctx.budget.max_duration_s)
        await allow_endpoint(ctx.sandbox, base_url, budget + _EGRESS_MARGIN_S)
        await self._prepare(ctx.sandbox, values)
        argv = self.argv(values, ctx.mcp_servers)
        env = {
            "PATH": f"{self.cache.bin_dir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": values["home"],
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            **{key: fill(value, values) for key, value in self.env.items()},
        }
        if ctx.mcp_servers and self.mcp_args is not None:
            env.update(self.mcp_env)
        started = time.time()
        try:
            result = await ctx.sandbox.exec(
                argv,
                timeout=budget,
                env=env,
                clear_env=True,
                cwd=values["workdir"],
                output_limit=self.output_limit,
            )
        except INFRASTRUCTURE_ERRORS as exc:
            raise InfrastructureError(
                FailureLayer.TOOL_EXEC, f"{type(exc).__name__}: {exc}", 1
            ) from exc
        stdout, stderr = result.stdout_text, result.stderr_text
        ctx.record.tool_events.append(
            ToolEvent(
                started_at=started,
                latency_s=time.time() - started,
                sandbox_id=ctx.sandbox.id,
                tool=self.name,
                arguments={"argv": argv, "program": self.program},
                exit_code=result.exit_code,
                output=stdout[-_RESULT_CHARS:],
            )
        )
        final = final_text(stdout)
        ctx.record.messages = [{"role": "user", "content": ctx.instruction}]
        if final:
            ctx.record.messages.append({"role": "assistant", "content": final})
        if result.timed_out:
            return HarnessOutcome("time_limit", truncated=True)
        if result.exit_code != 0:
            raise InfrastructureError(
                FailureLayer.HARNESS,
                f"{self.program} exited {result.exit_code} (signal {result.signal}): "
                f"{(stderr or stdout)[-2000:]}",
                1,
            )
        return HarnessOutcome("stopped", truncated=False)

    async def _prepare(self, sandbox: AsyncSandbox, values: Mapping[str, str]) -> None:
        try:
            made = await sandbox.exec(
                ["mkdir", "-p", values["home"], values["workdir"]], timeout=30
            )
            if not made.ok:
                raise InfrastructureError(
                    FailureLayer.HARNESS, f"cannot create the program's folders: {made}", 1
                )
            for spec in self.files:
                await sandbox.write_file(
                    fill(spec.path, values), fill(spec.content, values), mode=spec.mode
                )
        except INFRASTRUCTURE_ERRORS as exc:
            raise InfrastructureError(
                FailureLayer.TOOL_EXEC, f"{type(exc).__name__}: {exc}", 1
            ) from exc


def final_text(stdout: str) -> str:
    """The program's final answer when it printed a JSON result that names one."""
    text = stdout.strip()
    start = text.find("{")
    if start < 0:
        return text[-4000:]
    try:
        data = json.loads(text[start:])
    except ValueError:
        return text[-4000:]
    if isinstance(data, dict):
        for key in ("final", "result", "response", "output", "text"):
            value = data.get(key)
            if isinstance(value, str):
                return value
    return text[-4000:]


async def allow_endpoint(sandbox: AsyncSandbox, base_url: str, duration_s: float) -> None:
    """Let `sandbox` open TCP connections to `base_url`'s host and port for `duration_s`.

    Replaces the sandbox's network policy (rollout sandboxes have none of their own).
    """
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        raise InfrastructureError(
            FailureLayer.HARNESS,
            f"the model endpoint {base_url} is on loopback, which inside a sandbox is the "
            "sandbox's own: let the capture proxy listen on an address of this host that "
            "sandboxes route to (proxy.host, e.g. the host's own IPv4 address)",
            1,
        )
    expire = Timestamp()
    expire.FromSeconds(int(time.time() + duration_s))
    request = env_service_pb2.UpdateNetworkPolicyRequest(
        sandbox_id=sandbox.id,
        network_policy=env_pb2.NetworkPolicy(
            egress=[
                env_pb2.EgressRule(
                    destination=host,
                    ports=[port],
                    protocol=env_pb2.PROTOCOL_TCP,
                    expire_time=expire,
                )
            ]
        ),
        request_id=f"{sandbox.id}-model-endpoint",
    )
    client = sandbox.client
    token = client.settings.token
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        await client.stub.UpdateNetworkPolicy(request, metadata=metadata, timeout=client.timeout)
    except Exception as exc:  # grpc.aio.AioRpcError and its kin
        raise InfrastructureError(
            FailureLayer.SANDBOX_CREATE, f"cannot allow the model endpoint: {exc}", 1
        ) from exc
