"""A scripted credit judge behind an OpenAI-compatible chat endpoint: no model, no network.

It answers the reward library's credit-assignment question (`orchard.reward.judged.
assign_credit`) by reading the transcript in the prompt (``### Turn N`` / ``Action:`` /
``Observation:`` blocks) and valuing each turn by what its action does:

- reading code or running the tests raises the chance of resolving the task a little;
- the last change to the code before the end is the critical error of a failed attempt (the
  value drops there);
- the last turn ends low, as the calibration rules ask.

It is a heuristic standing in for a judge model so the credit stage runs on embedded defaults;
a recipe points ``stages.credit.judge_endpoint`` at a real model for anything else. Other
questions get HTTP 400.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from aiohttp import web

__all__ = ["ScriptedJudgeServer", "judge_reply"]

MODEL = "scripted-judge"
_TURN = re.compile(r"^### Turn (\d+)\nAction:\n(.*?)\nObservation:\n", re.MULTILINE | re.DOTALL)
_EDIT = re.compile(r"sed -i|tool call (edit|create)\(|>\s*\S+\.py|patch ")
_LOOK = re.compile(r"\b(cat|grep|ls|head|tail|sed -n|find)\b|tool call view\(|pytest")


def _kind(action: str) -> str:
    if "tool call submit(" in action:
        return "submit"
    if _EDIT.search(action):
        return "edit"
    if _LOOK.search(action):
        return "look"
    return "other"


def judge_reply(prompt: str) -> dict[str, Any]:
    """The annotation for a credit prompt; raises ValueError when it holds no transcript."""
    actions = {int(m.group(1)): m.group(2) for m in _TURN.finditer(prompt)}
    if not actions:
        raise ValueError("the prompt holds no '### Turn N' transcript to value")
    last = max(actions)
    kinds = [_kind(actions.get(t, "")) for t in range(last + 1)]
    edits = [t for t, kind in enumerate(kinds) if kind == "edit" and t > 0]
    critical = edits[-1] if edits else last
    values = []
    value = 0.4
    for turn, kind in enumerate(kinds):
        if turn == 0:
            value = 0.4
        elif turn == critical:
            value = 0.1
        elif turn == last:
            value = min(value, 0.05)
        elif turn > critical:
            value = min(value, 0.1)
        elif kind == "look":
            value = min(0.7, value + 0.1)
        values.append({"turn": turn, "value": round(value, 3)})
    if values[-1]["value"] >= 0.2:
        values[-1]["value"] = 0.05
    return {"values": values, "critical_turn": critical if critical > 0 else None}


class ScriptedJudgeServer:
    """`async with ScriptedJudgeServer() as judge:` serves at `judge.base_url` ("…/v1")."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.requests = 0
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def __aenter__(self) -> ScriptedJudgeServer:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()

    async def _completions(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            messages = body["messages"]
            prompt = "\n".join(m["content"] for m in messages if isinstance(m.get("content"), str))
            answer = judge_reply(prompt)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            error = {"message": f"not a credit question: {exc}", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400)
        self.requests += 1
        content = json.dumps(answer)
        return web.json_response(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": str(body.get("model") or MODEL),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            }
        )
