"""Calls to the Kubernetes API through kubernetes-asyncio, answered as plain JSON dicts.

The generated client turns every response into its model classes; the runtime reads a few
fields of Pods and policies, so it asks for the raw response (``_preload_content=False``) and
turns a non-2xx answer into :class:`KubeApiError` with the ``Status`` object's reason and
message.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import Any

import aiohttp

__all__ = ["KubeApiError", "call_api"]


class KubeApiError(Exception):
    """A non-2xx answer of the API server, or no answer at all (``code`` 0)."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}".strip())
        self.code = code
        self.reason = reason
        self.message = message


async def call_api(pending: Awaitable[Any]) -> dict[str, Any]:
    """Await one raw client call (made with ``_preload_content=False``) and decode it."""
    try:
        response = await pending
        try:
            body = await response.read()
        finally:
            response.release()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise KubeApiError(0, "Unreachable", f"the API server did not answer: {exc!r}") from exc
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        data = {"message": body.decode(errors="replace")[:500]}
    if not 200 <= response.status < 300:
        raise KubeApiError(
            response.status, str(data.get("reason", "")), str(data.get("message", ""))
        )
    return data if isinstance(data, dict) else {}
