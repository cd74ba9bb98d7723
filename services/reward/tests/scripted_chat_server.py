"""A test server: an OpenAI-compatible chat-completions endpoint on loopback that plays a script.

It speaks real HTTP (``/v1/chat/completions``) so the official ``openai`` client talks to it
unchanged, but its answers are scripted per request: a reply text, an HTTP status, a delay, or
a body that is not JSON. It is a stand-in for a judge model, named as such; it records every
request body so tests can check what was sent.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Step:
    """What the server does for one request."""

    reply: str = ""
    status: int = 200
    delay_s: float = 0.0
    raw_body: bytes | None = None


class ScriptedChatServer:
    def __init__(self) -> None:
        self.script: deque[Step] = deque()
        self.requests: list[dict[str, Any]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    def play(self, *steps: Step) -> None:
        self.script.extend(steps)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                owner.requests.append(body)
                step = owner.script.popleft() if owner.script else Step(status=503)
                if step.delay_s:
                    time.sleep(step.delay_s)
                if step.raw_body is not None:
                    payload = step.raw_body
                elif step.status != 200:
                    payload = json.dumps({"error": {"message": "scripted failure"}}).encode()
                else:
                    payload = json.dumps(_completion(body.get("model", ""), step.reply)).encode()
                try:
                    self.send_response(step.status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout) before the delayed answer

        return Handler

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _completion(model: str, text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


@contextmanager
def scripted_chat_server() -> Iterator[ScriptedChatServer]:
    server = ScriptedChatServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
