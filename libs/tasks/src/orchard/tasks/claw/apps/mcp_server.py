"""The MCP front end: one stdio MCP server with a tool per operation (``mail_send``,
``calendar_free``, ...), built with the official ``mcp`` SDK's low-level server.

A tool's result is the operation's JSON (as text and as structured content); a failed call is
a tool error (``isError``) whose text starts with its kind, e.g. ``transient: ...``, so a
model can tell a retryable failure from a wrong argument. ``--apps`` limits the tools served.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from .ops import APPS, OPERATIONS, call
from .store import ClawError

__all__ = ["build_server", "main"]


def build_server(apps: Sequence[str] = APPS) -> Server[Any]:
    chosen = {op.tool_name: op for op in OPERATIONS.values() if op.app in apps}

    async def list_tools(
        ctx: Any, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(
                    name=name,
                    description=f"{op.app}: {op.summary}",
                    input_schema=op.input_schema(),
                )
                for name, op in chosen.items()
            ]
        )

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        op = chosen.get(params.name)
        if op is None:
            text = f"invalid: no tool {params.name!r}; tools: {', '.join(chosen)}"
            return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)
        try:
            result = call(op.app, op.name, params.arguments or {}, via="mcp")
        except ClawError as exc:
            text = f"{exc.kind}: {exc}"
            return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)
        text = json.dumps(result, indent=2, ensure_ascii=False)
        return types.CallToolResult(
            content=[types.TextContent(text=text)], structured_content={"result": result}
        )

    return Server(
        "claw",
        version="0.1.0",
        instructions="Personal-assistant apps: mail, calendar, contacts, notes, documents.",
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def _serve(apps: Sequence[str]) -> None:
    server = build_server(apps)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


def main(argv: Sequence[str] | None = None) -> int:
    top = argparse.ArgumentParser(prog="claw-mcp", description=__doc__)
    top.add_argument(
        "--apps", default=",".join(APPS), help=f"comma-separated apps to serve ({','.join(APPS)})"
    )
    args = top.parse_args(argv)
    apps = [a.strip() for a in args.apps.split(",") if a.strip()]
    unknown = sorted(set(apps) - set(APPS))
    if unknown:
        top.error(f"unknown app(s) {', '.join(unknown)}; the apps are {', '.join(APPS)}")
    anyio.run(_serve, apps)
    return 0
