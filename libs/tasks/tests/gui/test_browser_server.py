"""The browser tool server as a harness reaches it: a separate process speaking MCP over
streamable HTTP, driven with the official SDK's client."""

from __future__ import annotations

import base64
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from orchard.tasks.gui.actions import TOOL_NAMES
from orchard.tasks.gui.sites import SiteServer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(90)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchard.tasks.gui.browser_server",
            "--listen",
            f"127.0.0.1:{port}",
            "--action-timeout",
            "3",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                stderr = process.stderr.read().decode() if process.stderr else ""
                pytest.fail(f"the browser server exited {process.returncode}: {stderr}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("the browser server did not listen within 30 s")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stderr:
            process.stderr.close()


async def test_mcp_tools_drive_the_browser(server_url: str, sites: SiteServer) -> None:
    from mcp import Client

    sites.reset("playground")
    async with Client(server_url) as client:
        tools = (await client.list_tools()).tools
        assert [t.name for t in tools] == list(TOOL_NAMES)
        click = next(t for t in tools if t.name == "click")
        assert click.input_schema["required"] == ["x", "y"]

        result = await client.call_tool("goto_url", {"url": sites.url("playground")})
        assert not result.is_error
        image, text = result.content
        assert image.type == "image" and image.mime_type == "image/png"
        assert base64.b64decode(image.data)[:4] == b"\x89PNG"
        assert text.type == "text" and "viewport: 1280x800" in text.text
        data = result.structured_content
        assert data["ok"] and data["tabs"][0]["title"] == "Widgets - Widget Playground"
        assert "screenshot_png_base64" not in data

        result = await client.call_tool("scroll", {"direction": "down", "amount": 100})
        assert not result.is_error and "y=100" in result.content[-1].text

        result = await client.call_tool("click", {"x": 5000, "y": 1})
        assert result.is_error
        assert result.content[-1].text.startswith("error (invalid_argument): click: x=5000")
        assert result.structured_content["error"] == "invalid_argument"

        result = await client.call_tool("teleport", {})
        assert result.is_error and "no tool 'teleport'" in result.content[-1].text

        result = await client.call_tool("done", {"response": "all good"})
        assert not result.is_error
        assert result.structured_content["done"] is True
        assert result.structured_content["response"] == "all good"


async def test_mcp_over_stdio(sites: SiteServer) -> None:
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    server = StdioServerParameters(
        command=sys.executable, args=["-m", "orchard.tasks.gui.browser_server"]
    )
    async with Client(server) as client:
        assert len((await client.list_tools()).tools) == 13
        result = await client.call_tool("goto_url", {"url": sites.url("shop")})
        assert not result.is_error
        assert result.structured_content["tabs"][0]["title"] == "Shop - Orchard Outfitters"
