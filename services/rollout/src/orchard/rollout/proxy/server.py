"""The capture proxy: an HTTP server in front of an inference engine that speaks the three APIs
harnesses use (OpenAI chat completions, the OpenAI Responses API, Anthropic Messages) and records
every call of every rollout with its exact tokens.

Routes (the rollout is named in the path, or by the API key on the plain path: OpenAI's
``Authorization: Bearer {rollout_id}`` or Anthropic's ``x-api-key: {rollout_id}``):

- ``POST [/rollouts/{rollout_id}]/v1/chat/completions`` (`openai_api`)
- ``POST [/rollouts/{rollout_id}]/v1/responses`` (`responses_api`)
- ``POST [/rollouts/{rollout_id}]/v1/messages`` (`anthropic_api`; ``?beta=true`` too)
- ``POST [/rollouts/{rollout_id}]/v1/messages/count_tokens``: the prompt's length in tokens
- ``GET  [/rollouts/{rollout_id}]/v1/models`` and ``/v1/models/{model_id}``, in Anthropic's shape
  for Anthropic's clients
- the side requests harnesses make before their first call (`http`), ``GET /healthz``; other
  paths get a JSON 404.

A harness may name an auxiliary branch of its rollout (a compaction, a sub-agent) with the
``X-Orchard-Branch`` header. Every generation route runs the same path: find the session, parse
the body into the one internal form (`turns.TurnRequest`: OpenAI chat messages and tools),
render it with the engine's tokenizer and chat template into prompt token ids, sample, parse the
sampled ids once into content and tool calls, record, and encode the answer in the request's
dialect. Streaming requests get the same single parse: the proxy buffers the whole turn, sending
keep-alives (SSE comments; Anthropic's ``ping`` events) while the engine samples, then sends the
turn as events.

When the engine serves a vision-language model (`engines.base.VisionEngine` with a processor),
a chat-completions conversation is rendered with the processor
(`orchard.lm.vision.VisionChatRenderer`, as the trainer's PrepareDataset renders it): each
``image_url`` part (a ``data:image/...;base64`` URL) becomes its image tokens in the prompt ids,
and the images' bytes go to the engine with them. The call's record keeps the ids (image tokens
expanded) and the messages (data URLs included). A text policy answers a conversation with
images HTTP 400 naming the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from orchard.lm.chat import (
    ChatFormatError,
    ChatImageError,
    ChatRenderer,
    RenderedPrompt,
    format_assistant_text,
)
from orchard.lm.vision import RenderedVisionPrompt, VisionChatRenderer
from orchard.rollout.capture import CallRecord
from orchard.rollout.engines.base import (
    EngineClosed,
    EngineError,
    Generation,
    InferenceEngine,
    InvalidRequest,
    NoWeightsLoaded,
    SamplingParams,
    TurnEngine,
    VisionEngine,
)
from orchard.rollout.proxy.anthropic_api import parse_messages_request
from orchard.rollout.proxy.http import (
    GENERATION_ROUTES,
    MESSAGES,
    ServedModel,
    add_side_routes,
    error_response,
    json_body,
    json_not_found,
    model_body,
    models_body,
    open_event_stream,
)
from orchard.rollout.proxy.sessions import (
    ROLLOUT_ID,
    CaptureSession,
    UnknownRollout,
)
from orchard.rollout.proxy.turns import (
    ApiError,
    Dialect,
    ModelTurn,
    TurnRequest,
    TurnStream,
    bad_request,
    model_turn,
    sampling_params,
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
    max_tokens_cap: int | None = Field(
        default=None,
        ge=1,
        description="Most tokens one call samples, whatever it asks for (an agent program "
        "asks for tens of thousands); None: what the call asks, else `default_max_tokens`.",
    )
    sampling_seed: int | None = Field(
        default=None,
        description="Seed of the draws of calls that bring no seed: each is sampled with "
        "`CaptureSession.call_seed` of it, so a rollout draws the same in every job with the "
        "same seed whatever runs beside it; None: fresh draws.",
    )


@dataclass(frozen=True, slots=True)
class SessionEndpoint:
    """How a harness reaches the proxy for one rollout, in each dialect's terms."""

    rollout_id: str
    base_url: str
    """For OpenAI clients (chat completions and the Responses API): ``.../rollouts/{id}/v1``."""
    api_key: str
    """The key that names the rollout on the plain paths (any client)."""
    anthropic_base_url: str
    """For Anthropic clients, which append ``/v1/messages`` themselves (Claude Code's
    ``ANTHROPIC_BASE_URL``): ``.../rollouts/{id}``."""


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
        app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[json_not_found]
        )
        app.router.add_get("/healthz", self._health)
        for prefix in ("/rollouts/{rollout_id}", ""):
            for path, dialect in GENERATION_ROUTES:
                app.router.add_post(prefix + path, self._generation_handler(dialect))
            app.router.add_post(f"{prefix}/v1/messages/count_tokens", self._count_tokens)
            app.router.add_get(f"{prefix}/v1/models", self._models)
            # Model ids may hold slashes ("org/name").
            app.router.add_get(f"{prefix}/v1/models/{{model_id:.+}}", self._model)
            add_side_routes(app.router, prefix, self._served_model)
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
            anthropic_base_url=f"{self.url}/rollouts/{rollout_id}",
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

    def _served_model(self) -> ServedModel:
        context: int | None
        try:
            context = self.engine.context_length
        except EngineError:
            context = None
        return ServedModel(self.engine.weight_version or "orchard", context)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session_of(request)
        except ApiError as e:
            return error_response(e, None, request)
        return web.json_response(models_body(request, self._served_model()))

    async def _model(self, request: web.Request) -> web.Response:
        """Any model id names the one policy: harnesses ask about the name they were given."""
        try:
            self._session_of(request)
        except ApiError as e:
            return error_response(e, None, request)
        served = self._served_model()
        requested = ServedModel(request.match_info["model_id"], served.context_length)
        return web.json_response(model_body(request, requested))

    def _session_of(self, request: web.Request) -> CaptureSession:
        """The session the path names, else the one the API key names (``x-api-key``, then
        ``Authorization: Bearer``)."""
        rollout_id = request.match_info.get("rollout_id")
        if rollout_id is None:
            key = request.headers.get("x-api-key", "").strip()
            if not key:
                scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
                key = bearer.strip() if scheme.lower() == "bearer" else ""
            if not key:
                raise ApiError(
                    401,
                    "name the rollout in the path (/rollouts/{id}/v1) or as the API key",
                    type="invalid_request_error",
                    code="invalid_api_key",
                )
            rollout_id = key
        session = self._sessions.get(rollout_id)
        if session is None:
            raise ApiError(
                404,
                f"no capture session is open for rollout {rollout_id!r}",
                code="rollout_not_found",
            )
        return session

    def _renderer(self) -> ChatRenderer:
        """The renderer of the loaded model: its processor's for a vision-language model, else
        its tokenizer's (one kept, rebuilt when the engine loads another model)."""
        engine = self.engine
        processor = engine.processor if isinstance(engine, VisionEngine) else None
        source = processor if processor is not None else engine.tokenizer
        renderer = self._renderers.get(id(source))
        if renderer is None:
            try:
                renderer = (
                    VisionChatRenderer(processor)
                    if processor is not None
                    else ChatRenderer(engine.tokenizer)
                )
            except ChatFormatError as e:
                raise ApiError(500, str(e), type="server_error") from None
            self._renderers = {id(source): renderer}
        return renderer

    def _render(self, renderer: ChatRenderer, turn: TurnRequest) -> RenderedPrompt:
        try:
            return renderer.render(turn.messages, turn.tools)
        except ChatImageError as e:
            where = str(e).split(":", 1)[0]
            raise bad_request(
                f"{where} holds an image, but the policy is a text model: run the GUI task "
                "with the `builtin:browser-text` "
                "harness (the page as text), or serve a vision-language model folder (a "
                "`vision_config` in its config.json) with the local engine",
                "messages",
                code="image_input_unsupported",
            ) from None
        except ChatFormatError as e:
            raise bad_request(str(e), "messages" if "messages" in str(e) else "tools") from None

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's ``count_tokens``: the rendered prompt's length with the real tokenizer."""
        try:
            self._session_of(request)
            turn = parse_messages_request(await json_body(request), counting=True)
            prompt = self._render(self._renderer(), turn)
        except ApiError as e:
            return error_response(e, MESSAGES, request)
        return web.json_response({"input_tokens": len(prompt.token_ids)})

    def _generation_handler(
        self, dialect: Dialect
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._generate(request, dialect)

        return handle

    async def _generate(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        """One model call in any dialect: session, parse, render, sample, parse, record,
        answer."""
        started_at, started = time.time(), time.monotonic()
        try:
            session = self._session_of(request)
            turn_request = dialect.parse(await json_body(request))
            renderer = self._renderer()
            prompt = self._render(renderer, turn_request)
            params = sampling_params(
                turn_request,
                default_max_tokens=self.config.default_max_tokens,
                stop_token_ids=renderer.stop_token_ids,
            )
            cap = self.config.max_tokens_cap
            if cap is not None and params.max_tokens > cap:
                params = dataclasses.replace(params, max_tokens=cap)
        except ApiError as e:
            return error_response(e, dialect, request)

        turn_id = dialect.new_turn_id()
        model = turn_request.model or self.engine.weight_version
        events = dialect.stream(
            turn_request, turn_id=turn_id, model=model, prompt_tokens=len(prompt.token_ids)
        )
        seq = await session.begin_call()
        params = dataclasses.replace(params, session=session.rollout_id)
        if params.seed is None and self.config.sampling_seed is not None:
            params = dataclasses.replace(
                params, seed=session.call_seed(self.config.sampling_seed, seq)
            )
        record: CallRecord | None = None
        response: web.StreamResponse | None = None
        images = prompt.images if isinstance(prompt, RenderedVisionPrompt) else ()
        generation = asyncio.ensure_future(
            self._sample(turn_request, prompt.token_ids, params, renderer, images)
        )
        try:
            if turn_request.stream:
                response = await self._keep_alive_until(request, generation, events)
            result = await self._result(generation)
            text, parsed = renderer.parse(result.token_ids)
            turn = model_turn(
                turn_id=turn_id,
                model=model,
                parsed=parsed,
                text=text,
                parse_tool_calls=turn_request.parse_tool_calls,
                engine_finish=result.finish_reason,
                stop=turn_request.stop,
                prompt_tokens=len(prompt.token_ids),
                completion_tokens=len(result.token_ids),
                tool_call_id=dialect.new_tool_call_id,
            )
            record = self._record(
                session=session,
                seq=seq,
                request=turn_request,
                prompt_ids=prompt.token_ids,
                result=result,
                text=text,
                unparsed_tool_calls=parsed.unparsed_tool_calls,
                turn=turn,
                started_at=started_at,
                started=started,
                branch=request.headers.get(BRANCH_HEADER, ""),
                images=len(images),
            )
            if not turn_request.stream:
                return web.json_response(dialect.answer(turn, turn_request))
            if response is None:
                response = await open_event_stream(request)
                await response.write(events.opening())
            await response.write(events.turn(turn))
            await response.write_eof()
            return response
        except ApiError as e:
            if response is None:
                return error_response(e, dialect, request)
            # The stream is open (status 200 sent): the error goes in the stream.
            with contextlib.suppress(ConnectionError):
                await response.write(events.error(e))
                await response.write_eof()
            return response
        finally:
            if not generation.done():
                generation.cancel()
            await session.end_call(record)

    async def _sample(
        self,
        request: TurnRequest,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        renderer: ChatRenderer,
        images: tuple[bytes, ...] = (),
    ) -> Generation:
        """The engine's sample (with the prompt's images for a vision-language model); a turn
        engine's decided turn written in the chat template's tokens, as a model of its
        tokenizer would have sampled it (logprobs 0.0)."""
        if images and isinstance(self.engine, VisionEngine):
            return await self.engine.generate(prompt_ids, params, images=images)
        if not isinstance(self.engine, TurnEngine):
            return await self.engine.generate(prompt_ids, params)
        content, calls = await self.engine.decide(request.messages, request.tools, params)
        text = format_assistant_text(content, calls)
        ids = [int(i) for i in self.engine.tokenizer.encode(text, add_special_tokens=False)]
        ids += renderer.stop_token_ids[:1]
        return Generation(
            token_ids=tuple(ids),
            logprobs=(0.0,) * len(ids),
            finish_reason="stop",
            weight_version=self.engine.weight_version,
            prompt_tokens=len(prompt_ids),
        )

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

    async def _keep_alive_until(
        self, request: web.Request, generation: asyncio.Future[Generation], events: TurnStream
    ) -> web.StreamResponse | None:
        """Wait for the engine, opening the stream and sending a keep-alive each interval.

        Returns None when the engine answered (or failed) within the first interval, so an
        error the engine raises at once (a prompt too long) still gets its HTTP status.
        """
        response: web.StreamResponse | None = None
        while True:
            done, _ = await asyncio.wait({generation}, timeout=self.config.keepalive_interval_s)
            if done:
                return response
            if response is None:
                response = await open_event_stream(request)
                await response.write(events.opening())
            await response.write(events.keepalive())

    def _record(
        self,
        *,
        session: CaptureSession,
        seq: int,
        request: TurnRequest,
        prompt_ids: tuple[int, ...],
        result: Generation,
        text: str,
        unparsed_tool_calls: int,
        turn: ModelTurn,
        started_at: float,
        started: float,
        branch: str,
        images: int = 0,
    ) -> CallRecord:
        metadata = {
            "api": request.api,
            "model": request.model,
            "stream": str(request.stream).lower(),
        }
        if images:
            # The prompt ids hold the images' tokens; the pixels stay in request_messages.
            metadata["images"] = str(images)
        if request.ignored_tools:
            metadata["ignored_tools"] = ",".join(request.ignored_tools)
        if unparsed_tool_calls and request.parse_tool_calls:
            metadata["unparsed_tool_calls"] = str(unparsed_tool_calls)
        return CallRecord(
            rollout_id=session.rollout_id,
            call_id=turn.id,
            seq=seq,
            prompt_token_ids=prompt_ids,
            output_token_ids=result.token_ids,
            output_logprobs=result.logprobs,
            weight_version=result.weight_version,
            finish_reason=turn.finish_reason,
            started_at=started_at,
            latency_s=time.monotonic() - started,
            request_messages=tuple(dict(m) for m in request.messages),
            output_text=text,
            tool_calls=turn.tool_calls,
            branch=branch,
            metadata=metadata,
        )
