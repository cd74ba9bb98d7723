"""The browser tool server: one browser (`BrowserSession`) behind an MCP server with the 13
tools, built with the official ``mcp`` SDK's low-level server.

Run it inside a browser sandbox::

    python -m orchard.tasks.gui.browser_server                       # MCP over stdio
    python -m orchard.tasks.gui.browser_server --listen 0.0.0.0:8931  # streamable HTTP at /mcp
    python -m orchard.tasks.gui.browser_server --listen unix:/run/browser.sock

Over HTTP it also answers ``POST /call`` with a JSON body ``{"tool": ..., "arguments": {...}}``:
the observation as JSON (`Observation.to_dict`, screenshot included), for a client that speaks
no MCP (the one-line client ``orchard-browser-call`` of a browser sandbox). A browser sandbox
serves on a Unix socket, which no web page can reach: a page's scripts can send requests to any
TCP port of the sandbox's loopback, a socket file they cannot name.

Every tool's result is the observation: an image (the PNG screenshot of the active tab) and a
text summary (the action's result, notes such as dialogs and popups, the viewport and the tabs),
with the observation as structured content (``ok``, ``error``, ``message``, ``events``,
``dialogs``, ``viewport``, ``tabs``, ``active_tab``, ``done``, ``response``; no screenshot). A
failed call (bad arguments, timeout, crash) is a tool error (``isError``) whose text starts with
``error (<kind>):``, and still carries the screenshot.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Sequence
from typing import Any

import anyio
import mcp_types as types
import uvicorn  # a dependency of mcp's HTTP transport
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .actions import TOOLS
from .browser import BrowserConfig, BrowserSession
from .observation import Observation

__all__ = ["build_server", "call_route", "main", "observation_result"]

_log = logging.getLogger("orchard.tasks.gui.browser_server")


def observation_result(observation: Observation) -> types.CallToolResult:
    """An observation as an MCP tool result: the screenshot as an image, then the summary."""
    content: list[types.ContentBlock] = []
    if observation.screenshot is not None:
        data = observation.screenshot_base64() or ""
        content.append(types.ImageContent(data=data, mime_type="image/png"))
    content.append(types.TextContent(text=observation.summary()))
    return types.CallToolResult(
        content=content,
        structured_content=observation.to_dict(screenshot=False),
        is_error=not observation.ok,
    )


def build_server(browser: BrowserSession) -> Server[Any]:
    """An MCP server whose tools drive ``browser`` (started and closed by the caller)."""

    async def list_tools(
        ctx: Any, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(
                    name=spec.name, description=spec.description, input_schema=spec.parameters()
                )
                for spec in TOOLS.values()
            ]
        )

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        # Unknown tools and bad arguments come back as observations that say what to fix.
        return observation_result(await browser.call(params.name, params.arguments or {}))

    return Server(
        "orchard-browser",
        version="0.1.0",
        instructions=(
            "A web browser. Look at the screenshot after each action; coordinates are viewport "
            "pixels of that screenshot. Call done with your answer when the task is finished."
        ),
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def _cancel_on_signal(scope: anyio.CancelScope) -> None:
    # SIGTERM's default action would kill the process before the browser and its profile
    # folder are cleaned up.
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


async def _serve_stdio(config: BrowserConfig) -> None:
    async with BrowserSession(config) as browser:
        server = build_server(browser)
        async with stdio_server() as (read_stream, write_stream), anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_signal, tg.cancel_scope)
            await server.run(read_stream, write_stream, server.create_initialization_options())
            tg.cancel_scope.cancel()


def call_route(browser: BrowserSession) -> Route:
    """``POST /call``: one tool call as JSON in, the observation as JSON out (400 for a body
    that is not a JSON object naming a tool; the tool's own failures are observations)."""

    async def call(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)
        if not isinstance(body, dict) or not isinstance(body.get("tool"), str):
            return JSONResponse(
                {"error": 'send {"tool": <name>, "arguments": {...}}'}, status_code=400
            )
        arguments = body.get("arguments") or {}
        if not isinstance(arguments, dict):
            return JSONResponse({"error": "arguments must be an object"}, status_code=400)
        observation = await browser.call(body["tool"], arguments)
        return JSONResponse(observation.to_dict(screenshot=True))

    return Route("/call", call, methods=["POST"])


def _bind(listen: str) -> socket.socket:
    """A bound socket for ``HOST:PORT`` or ``unix:PATH`` (a stale socket file is replaced)."""
    if listen.startswith("unix:"):
        path = listen[len("unix:") :]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        os.chmod(path, 0o600)  # its owner and root only
        sock.listen(64)  # calls made while the browser starts wait for it
        return sock
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ValueError(f"--listen {listen!r}: give HOST:PORT (127.0.0.1:8931) or unix:PATH")
    # Bound first, so port 0 (any free port) is known before the log line that names it.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(64)
    return sock


def _where(sock: socket.socket) -> str:
    bound = sock.getsockname()
    return f"unix:{bound}" if sock.family == socket.AF_UNIX else f"http://{bound[0]}:{bound[1]}"


async def _serve_http(config: BrowserConfig, sock: socket.socket) -> None:
    server: uvicorn.Server | None = None

    def stop(signum: int, frame: object) -> None:
        if server is not None:
            server.should_exit = True

    # uvicorn re-raises the signal that stopped it once it has restored the handlers it found:
    # with these in place, that ends the serve call instead of the process, so the browser and
    # its profile folder are cleaned up.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    async with BrowserSession(config) as browser:
        host = "127.0.0.1" if sock.family == socket.AF_UNIX else str(sock.getsockname()[0])
        app = build_server(browser).streamable_http_app(host=host)
        app.router.routes.append(call_route(browser))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        _log.info("browser tool server at %s (MCP at /mcp, JSON at /call)", _where(sock))
        await server.serve(sockets=[sock])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchard.tasks.gui.browser_server",
        description="Serve one headless Chromium's 13 browser tools over MCP.",
    )
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT|unix:PATH",
        help="serve MCP streamable HTTP at /mcp and JSON calls at /call, on a TCP port or a "
        "Unix socket (default: MCP over stdio)",
    )
    parser.add_argument("--chromium", default=BrowserConfig.executable_path, help="the binary")
    parser.add_argument("--width", type=int, default=BrowserConfig.viewport_width)
    parser.add_argument("--height", type=int, default=BrowserConfig.viewport_height)
    parser.add_argument(
        "--action-timeout", type=float, default=BrowserConfig.action_timeout_s, help="seconds"
    )
    parser.add_argument(
        "--dialogs", choices=("accept", "dismiss"), default="accept", help="how to answer dialogs"
    )
    parser.add_argument(
        "--chromium-sandbox",
        choices=("auto", "on", "off"),
        default="auto",
        help="Chromium's own sandbox (auto: on unless running as root, which cannot use it; it "
        "needs user namespaces)",
    )
    args = parser.parse_args(argv)
    try:
        config = BrowserConfig(
            executable_path=args.chromium,
            viewport_width=args.width,
            viewport_height=args.height,
            action_timeout_s=args.action_timeout,
            dialog_answer=args.dialogs,
            sandbox={"auto": None, "on": True, "off": False}[args.chromium_sandbox],
        )
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.listen is None:
        anyio.run(_serve_stdio, config)
        return 0
    try:
        sock = _bind(args.listen)
    except ValueError as exc:
        parser.error(str(exc))
    except OSError as exc:
        parser.error(f"--listen {args.listen!r}: {exc.strerror or exc}")
    anyio.run(_serve_http, config, sock)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
