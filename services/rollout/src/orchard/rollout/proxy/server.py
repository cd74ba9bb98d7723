"""The capture proxy: an OpenAI-compatible chat-completions server in front of an inference
engine, recording every call of every rollout with its exact tokens.

Routes (the rollout is named in the path, or by the API key on the plain path):

- ``POST /rollouts/{rollout_id}/v1/chat/completions``
- ``POST /v1/chat/completions`` with ``Authorization: Bearer {rollout_id}``
- ``GET  /rollouts/{rollout_id}/v1/models`` and ``GET /v1/models``
- ``GET  /healthz``

A harness may name an auxiliary branch of its rollout (a compaction, a sub-agent) with the
``X-Orchard-Branch`` header. Messages are rendered with the engine's tokenizer and the chat
template into prompt token ids; the engine samples; the sampled ids are parsed once into content
and tool calls. Streaming requests get the same single parse: the proxy buffers the whole turn,
sending SSE comments as keep-alives while the engine samples, then sends the turn as chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from orchard.lm.chat import ChatFormatError, ChatRenderer
from orchard.rollout.capture import CallRecord
from orchard.rollout.engines.base import (
    EngineClosed,
    EngineError,
    Generation,
    InferenceEngine,
    InvalidRequest,
    NoWeightsLoaded,
)
from orchard.rollout.proxy.openai_api import (
    Answer,
    ApiError,
    ChatCompletionRequest,
    answer_for,
    bad_request,
    parse_chat_request,
    sampling_params,
)
from orchard.rollout.proxy.sessions import (
    ROLLOUT_ID,
    CaptureSession,
    UnknownRollout,
)

log = logging.getLogger(__name__)

BRANCH_HEADER = "X-Orchard-Branch"


class CaptureProxyConfig(BaseModel):
    """Where the capture proxy listens and how it answers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=0, ge=0, le=65535, description="Port; 0 picks a free one.")
    public_url: str | None = Field(
        default=None,
        description="The base URL harnesses reach the proxy at, when not http://host:port "
        "(e.g. the address a sandbox's network policy allows).",
    )
    default_max_tokens: int = Field(
        default=1024, ge=1, description="Output budget of a call that names none."
    )
    keepalive_interval_s: float = Field(
        default=5.0, gt=0, description="Seconds between SSE keep-alive comments while sampling."
    )
    settle_quiet_s: float = Field(
        default=0.2,
        ge=0,
        description="How long a rollout must see no call start or finish to count as settled.",
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="Largest request body accepted."
    )


@dataclass(frozen=True, slots=True)
class SessionEndpoint:
    """How a harness reaches the proxy for one rollout: point an OpenAI client at these."""

    rollout_id: str
    base_url: str
    api_key: str


class CaptureProxy:
    """`async with CaptureProxy(engine, config) as proxy:` serves until exit.

    `open_session(rollout_id)` before a rollout's first call, `settle(rollout_id, timeout)`
    once its harness is done, `close_session(rollout_id)` when the records are taken.
    """

    def __init__(self, engine: InferenceEngine, config: CaptureProxyConfig | None = None) -> None:
        self.engine = engine
        self.config = config or CaptureProxyConfig()
        self._sessions: dict[str, CaptureSession] = {}
        self._renderers: dict[int, ChatRenderer] = {}
        self._runner: web.AppRunner | None = None
        self._port = 0

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/rollouts/{rollout_id}/v1/chat/completions", self._chat)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/rollouts/{rollout_id}/v1/models", self._models)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._health)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port)
        await site.start()
        self._runner = runner
        self._port = int(runner.addresses[0][1])
        log.info("capture proxy listening on %s", self.url)

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> CaptureProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def url(self) -> str:
        """The proxy's base URL (`public_url` when configured)."""
        if self.config.public_url:
            return self.config.public_url.rstrip("/")
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self._port}"

    # -- sessions -------------------------------------------------------------------------

    def open_session(
        self, rollout_id: str, labels: Mapping[str, str] | None = None
    ) -> SessionEndpoint:
        """Start capturing calls for `rollout_id`; returns where its harness should connect."""
        if not ROLLOUT_ID.match(rollout_id):
            raise ValueError(
                f"rollout id {rollout_id!r} must be 1-200 characters of letters, digits, "
                "'.', '_', ':' or '-'"
            )
        if rollout_id in self._sessions:
            raise ValueError(f"a capture session for rollout {rollout_id!r} is already open")
        self._sessions[rollout_id] = CaptureSession(rollout_id, dict(labels or {}))
        return SessionEndpoint(
            rollout_id=rollout_id,
            base_url=f"{self.url}/rollouts/{rollout_id}/v1",
            api_key=rollout_id,
        )

    def session(self, rollout_id: str) -> CaptureSession:
        try:
            return self._sessions[rollout_id]
        except KeyError:
            raise UnknownRollout(f"no capture session is open for rollout {rollout_id!r}") from None

    async def settle(
        # The timeout is part of settling: it decides when capture gives up, and says so.
        self,
        rollout_id: str,
        timeout: float,  # noqa: ASYNC109
        *,
        quiet_s: float | None = None,
    ) -> tuple[CallRecord, ...]:
        """The rollout's records in arrival order, once none is pending and their count has
        been stable for `quiet_s` (default `settle_quiet_s`); raises `CaptureNotSettled` after
        `timeout` seconds, `UnknownRollout` for a session that is not open."""
        quiet = self.config.settle_quiet_s if quiet_s is None else quiet_s
        return await self.session(rollout_id).settle(timeout, quiet)

    def close_session(self, rollout_id: str) -> CaptureSession:
        """Stop capturing for `rollout_id`; later calls for it get HTTP 404."""
        session = self.session(rollout_id)
        del self._sessions[rollout_id]
        return session

    # -- handlers -------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "weight_version": self.engine.weight_version})

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session_of(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        model = {
            "id": self.engine.weight_version or "orchard",
            "object": "model",
            "created": 0,
            "owned_by": "orchard",
        }
        return web.json_response({"object": "list", "data": [model]})

    def _session_of(self, request: web.Request) -> CaptureSession:
        rollout_id = request.match_info.get("rollout_id")
        if rollout_id is None:
            auth = request.headers.get("Authorization", "")
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not key.strip():
                raise ApiError(
                    401,
                    "name the rollout in the path (/rollouts/{id}/v1) or as the API key",
                    type="invalid_request_error",
                    code="invalid_api_key",
                )
            rollout_id = key.strip()
        session = self._sessions.get(rollout_id)
        if session is None:
            raise ApiError(
                404,
                f"no capture session is open for rollout {rollout_id!r}",
                code="rollout_not_found",
            )
        return session

    def _renderer(self) -> ChatRenderer:
        tokenizer = self.engine.tokenizer
        renderer = self._renderers.get(id(tokenizer))
        if renderer is None:
            renderer = ChatRenderer(tokenizer)
            self._renderers = {id(tokenizer): renderer}
        return renderer

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        started_at, started = time.time(), time.monotonic()
        try:
            session = self._session_of(request)
            try:
                body = await request.json(loads=json.loads)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise bad_request(f"the request body is not valid JSON: {e}") from None
            chat = parse_chat_request(body)
            renderer = self._renderer()
            try:
                prompt = renderer.render(chat.messages, chat.tools)
            except ChatFormatError as e:
                raise bad_request(str(e), "messages" if "messages" in str(e) else "tools") from None
            params = sampling_params(
                chat,
                default_max_tokens=self.config.default_max_tokens,
                stop_token_ids=renderer.stop_token_ids,
            )
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPRequestEntityTooLarge:
            error = bad_request("the request body is too large", code="request_too_large")
            return web.json_response(error.body(), status=413)

        seq = await session.begin_call()
        record: CallRecord | None = None
        response: web.StreamResponse | None = None
        generation = asyncio.ensure_future(self.engine.generate(prompt.token_ids, params))
        try:
            if chat.stream:
                response = await self._keep_alive_until(request, generation)
            result = await self._result(generation)
            record, answer = self._record(
                session=session,
                seq=seq,
                chat=chat,
                prompt_ids=prompt.token_ids,
                result=result,
                renderer=renderer,
                started_at=started_at,
                started=started,
                request=request,
            )
            if not chat.stream:
                return web.json_response(answer.completion())
            if response is None:
                response = await self._open_stream(request)
            for chunk in answer.chunks(include_usage=chat.include_usage):
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        except ApiError as e:
            if response is None:
                return web.json_response(e.body(), status=e.status)
            # The stream is open (status 200 sent): the error goes in the stream, as OpenAI does.
            with contextlib.suppress(ConnectionError):
                await response.write(f"data: {json.dumps(e.body())}\n\n".encode())
                await response.write_eof()
            return response
        finally:
            if not generation.done():
                generation.cancel()
            await session.end_call(record)

    @staticmethod
    async def _result(generation: asyncio.Future[Generation]) -> Generation:
        """The engine's answer, its errors as HTTP errors."""
        try:
            return await generation
        except InvalidRequest as e:
            raise bad_request(str(e), code="context_length_exceeded") from None
        except (EngineClosed, NoWeightsLoaded) as e:
            raise ApiError(503, str(e), type="server_error", code="engine_unavailable") from None
        except EngineError as e:
            raise ApiError(500, str(e), type="server_error") from None

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        return response

    async def _keep_alive_until(
        self, request: web.Request, generation: asyncio.Future[Generation]
    ) -> web.StreamResponse | None:
        """Wait for the engine, opening the stream and sending an SSE comment each interval.

        Returns None when the engine answered (or failed) within the first interval, so an
        error the engine raises at once (a prompt too long) still gets its HTTP status.
        """
        response: web.StreamResponse | None = None
        while True:
            done, _ = await asyncio.wait({generation}, timeout=self.config.keepalive_interval_s)
            if done:
                return response
            if response is None:
                response = await self._open_stream(request)
            await response.write(b": keep-alive\n\n")

    def _record(
        self,
        *,
        session: CaptureSession,
        seq: int,
        chat: ChatCompletionRequest,
        prompt_ids: tuple[int, ...],
        result: Generation,
        renderer: ChatRenderer,
        started_at: float,
        started: float,
        request: web.Request,
    ) -> tuple[CallRecord, Answer]:
        call_id = f"chatcmpl-{uuid.uuid4().hex}"
        text, turn = renderer.parse(result.token_ids)
        tool_call_count = len(turn.tool_calls) if chat.parse_tool_calls else 0
        answer = answer_for(
            completion_id=call_id,
            model=chat.model or result.weight_version,
            turn=turn,
            text=text,
            parse_tool_calls=chat.parse_tool_calls,
            engine_finish=result.finish_reason,
            stop=chat.stop,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(result.token_ids),
            call_ids=[f"call_{uuid.uuid4().hex[:24]}" for _ in range(tool_call_count)],
        )
        metadata = {"model": chat.model, "stream": str(chat.stream).lower()}
        if turn.unparsed_tool_calls:
            metadata["unparsed_tool_calls"] = str(turn.unparsed_tool_calls)
        record = CallRecord(
            rollout_id=session.rollout_id,
            call_id=call_id,
            seq=seq,
            prompt_token_ids=prompt_ids,
            output_token_ids=result.token_ids,
            output_logprobs=result.logprobs,
            weight_version=result.weight_version,
            finish_reason=answer.finish_reason,
            started_at=started_at,
            latency_s=time.monotonic() - started,
            request_messages=tuple(dict(m) for m in chat.messages),
            output_text=text,
            tool_calls=answer.tool_calls,
            branch=request.headers.get(BRANCH_HEADER, ""),
            metadata=metadata,
        )
        return record, answer
