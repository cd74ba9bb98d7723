"""HTTP pieces the capture proxy and the scripted policy's server share: the dialect of each
generation route, reading a JSON body, opening an event stream, the model listing in OpenAI's and
Anthropic's shapes, the side requests harnesses make before their first call, and JSON 404s.

Side requests (answered without a session, from what the server already knows):

- ``GET|HEAD /`` and ``GET|HEAD /api/hello``: ``{"status": "ok"}`` (reachability probes);
- ``GET /health``: the same;
- ``GET /api/version``: ``{"version": ...}``; ``GET /api/tags`` and ``POST /api/show``: the one
  model in Ollama's shapes, its context length in ``model_info`` (harnesses read it there);
- ``GET /v1/props`` and ``GET /props``: llama.cpp's server properties (``n_ctx``).

Every other path gets HTTP 404 with a JSON error body naming it (405 for a known path with the
wrong method), in Anthropic's shape when the request carries Anthropic's headers.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from orchard.rollout.proxy.anthropic_api import MessagesDialect
from orchard.rollout.proxy.anthropic_api import error_body as anthropic_error_body
from orchard.rollout.proxy.openai_api import ChatCompletionsDialect
from orchard.rollout.proxy.responses_api import ResponsesDialect
from orchard.rollout.proxy.turns import ApiError, Dialect, bad_request

VERSION = "0.1.0"

CHAT_COMPLETIONS = ChatCompletionsDialect()
RESPONSES = ResponsesDialect()
MESSAGES = MessagesDialect()
GENERATION_ROUTES: tuple[tuple[str, Dialect], ...] = (
    ("/v1/chat/completions", CHAT_COMPLETIONS),
    ("/v1/responses", RESPONSES),
    ("/v1/messages", MESSAGES),
)
"""The path (after the optional ``/rollouts/{rollout_id}`` prefix) each dialect is served at."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The one model a server answers with, as side requests describe it."""

    id: str
    context_length: int | None = None


def speaks_anthropic(request: web.Request) -> bool:
    """Whether the client is Anthropic's (its SDK sends ``anthropic-version``)."""
    return "anthropic-version" in request.headers or "x-api-key" in request.headers


def error_response(error: ApiError, dialect: Dialect | None, request: web.Request) -> web.Response:
    """The error in `dialect`'s shape (guessed from the headers when there is no dialect)."""
    if dialect is not None:
        body = dialect.error_body(error)
    elif speaks_anthropic(request):
        body = anthropic_error_body(error)
    else:
        body = error.body()
    return web.json_response(body, status=error.status)


async def json_body(request: web.Request) -> Any:
    """The decoded body; `ApiError` 400 when it is not JSON, 413 when it is too large."""
    try:
        return await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, "the request body is too large", code="request_too_large") from None


async def open_event_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    return response


def models_body(request: web.Request, model: ServedModel) -> dict[str, Any]:
    """``GET /v1/models`` in the client's dialect."""
    entry = model_body(request, model)
    if speaks_anthropic(request):
        return {"data": [entry], "has_more": False, "first_id": model.id, "last_id": model.id}
    return {"object": "list", "data": [entry]}


def model_body(request: web.Request, model: ServedModel) -> dict[str, Any]:
    """``GET /v1/models/{id}`` in the client's dialect."""
    if speaks_anthropic(request):
        return {
            "type": "model",
            "id": model.id,
            "display_name": model.id,
            "created_at": "1970-01-01T00:00:00Z",
            "max_input_tokens": model.context_length,
            "max_tokens": model.context_length,
        }
    body: dict[str, Any] = {
        "id": model.id,
        "object": "model",
        "created": 0,
        "owned_by": "orchard",
    }
    if model.context_length:
        # vLLM's and OpenRouter's names for it: harnesses size their prompts from these.
        body["max_model_len"] = model.context_length
        body["context_length"] = model.context_length
    return body


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_side_routes(
    router: web.UrlDispatcher, prefix: str, model: Callable[[], ServedModel]
) -> None:
    """Register the side requests under `prefix` ("" or ``/rollouts/{rollout_id}``)."""

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    def ollama(served: ServedModel) -> dict[str, Any]:
        return {
            "name": served.id,
            "model": served.id,
            "modified_at": "1970-01-01T00:00:00Z",
            "size": 0,
            "digest": "",
            "details": {"format": "orchard", "family": "orchard", "parameter_size": ""},
        }

    async def tags(request: web.Request) -> web.Response:
        return web.json_response({"models": [ollama(model())]})

    async def show(request: web.Request) -> web.Response:
        served = model()
        info: dict[str, Any] = {"general.architecture": "orchard"}
        if served.context_length:
            info["orchard.context_length"] = served.context_length
        return web.json_response(
            {
                **ollama(served),
                "modelfile": "",
                "parameters": "",
                "template": "",
                "model_info": info,
                "capabilities": ["completion", "tools"],
            }
        )

    async def props(request: web.Request) -> web.Response:
        served = model()
        return web.json_response(
            {
                "model_path": served.id,
                "n_ctx": served.context_length,
                "default_generation_settings": {"n_ctx": served.context_length},
                "total_slots": 1,
            }
        )

    routes: list[tuple[str, str, Handler]] = [
        ("GET", prefix or "/", ok),
        ("GET", f"{prefix}/api/hello", ok),
        ("GET", f"{prefix}/health", ok),
        ("GET", f"{prefix}/api/version", version),
        ("GET", f"{prefix}/api/tags", tags),
        ("POST", f"{prefix}/api/show", show),
        ("GET", f"{prefix}/v1/props", props),
        ("GET", f"{prefix}/props", props),
    ]
    if prefix:
        routes.append(("GET", f"{prefix}/", ok))
    for method, path, handler in routes:
        if method == "GET":
            router.add_get(path, handler)  # HEAD too
        else:
            router.add_post(path, handler)


@web.middleware
async def json_not_found(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown paths and wrong methods answered with a JSON error body."""
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as e:
        if e.status == 404:
            message = (
                f"no route for {request.method} {request.path}: this server answers "
                "/v1/chat/completions, /v1/responses, /v1/messages and /v1/models, "
                "optionally under /rollouts/{rollout_id}"
            )
            error = ApiError(404, message, code="unknown_route")
        else:
            error = ApiError(405, f"{request.method} is not allowed on {request.path}")
        return error_response(error, None, request)
