"""The HTTP server: routes on one `AsyncLLM`, the API key check, and the process's life from the first
request to a clean exit on SIGINT / SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import socket
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from llmserve import __version__
from llmserve.config import EngineArgs
from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.core_launcher import LOG_FORMAT
from llmserve.engine.exceptions import EngineDeadError
from llmserve.entrypoints.openai.data_parallel import with_header_rank
from llmserve.entrypoints.openai.disconnect import cancel_on_disconnect
from llmserve.entrypoints.openai.embedding_protocol import EmbeddingRequest, EmbeddingResponse
from llmserve.entrypoints.openai.errors import (
    ErrorResponse,
    OpenAIError,
    engine_dead,
    install_error_handlers,
)
from llmserve.entrypoints.openai.limits import RequestBodyLimitMiddleware, head_timeout_protocol
from llmserve.entrypoints.openai.playground import mount_playground
from llmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from llmserve.entrypoints.openai.published_limits import Limits, publish_limits
from llmserve.entrypoints.openai.request_id import RequestIdEchoMiddleware, with_header_id
from llmserve.entrypoints.openai.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from llmserve.entrypoints.openai.server_args import ServerArgs
from llmserve.entrypoints.openai.serving_chat import OpenAIServingChat
from llmserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from llmserve.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from llmserve.entrypoints.openai.serving_models import ServedModels
from llmserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from llmserve.entrypoints.openai.streaming import EventStreamResponse
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.metrics.stats import IterationStats
from llmserve.structured_output import grammars

logger = logging.getLogger("llmserve")

# On shutdown, requests still running after this long are ended (which aborts them).
SHUTDOWN_GRACE_SECONDS = 5
# /metrics asks the core for its current queue and KV numbers (it sends none while idle), briefly.
SCHEDULER_STATS_TIMEOUT_SECONDS = 1.0
# /openapi.json: every error, whatever its status, is OpenAI's error body (never FastAPI's 422 shape).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "The request was refused (OpenAI's error body)."},
    "5XX": {"model": ErrorResponse, "description": "The server failed or is stopping."},
}


def json_or_events(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """/openapi.json's 200 of a generating route: `model` as JSON, or Server-Sent Events if `stream`."""
    # In Open API 3.1 an event stream's `schema` describes one event: `data: <chunk JSON>`, `data: [DONE]`.
    event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
    return {200: {"model": model, "content": {"text/event-stream": {"schema": event}}}}


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header, as sent; the scheme is
    case-insensitive (RFC 9110)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class ApiKeyMiddleware:
    """`/v1/*` (and `also_guarded` paths) need `Authorization: Bearer <key>`; the rest (health,
    metrics, tokenize unless guarded, the playground's page, whose API calls carry the key) stays open.
    Header values are bytes: a non-ASCII key matches as UTF-8 (curl, most clients) or Latin-1 (the
    HTTP default). Plain ASGI, not Starlette's `BaseHTTPMiddleware`, which would hide client
    disconnects."""

    def __init__(self, app: ASGIApp, api_key: str, also_guarded: tuple[str, ...] = ()) -> None:
        self.app = app
        self.also_guarded = also_guarded
        self.expected = {api_key.encode("utf-8")}
        with contextlib.suppress(UnicodeEncodeError):
            self.expected.add(api_key.encode("latin-1"))

    def _accepts(self, token: bytes | None) -> bool:
        # every candidate compared, in constant time each, so timing tells nothing about which matched
        matches = [hmac.compare_digest(token or b"", key) for key in self.expected]
        return token is not None and any(matches)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = (
            scope["type"] == "http"
            and (scope["path"].startswith("/v1/") or scope["path"] in self.also_guarded)
            and scope["method"] != "OPTIONS"
        )
        if guarded and not self._accepts(bearer_token(scope["headers"])):
            error = OpenAIError(
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                status=401,
                code="invalid_api_key",
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    """Uvicorn, plus: on shutdown, requests still running after `grace` seconds are ended (with a 503
    error event or body) by setting `stopping`, so that every connection closes cleanly."""

    def __init__(self, config: uvicorn.Config, stopping: asyncio.Event, grace: float) -> None:
        super().__init__(config)
        self.stopping = stopping
        self.grace = grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().call_later(self.grace, self.stopping.set)
        await super().shutdown(sockets)


def build_app(
    engine: AsyncLLM,
    args: ServerArgs,
    metrics: PrometheusStatLogger,
    stopping: asyncio.Event,
    executor: Executor | None = None,
    tokenize_executor: Executor | None = None,
) -> FastAPI:
    """The routes on `engine`, which the caller owns (and shuts down); `metrics` must be one of its
    stat loggers; setting `stopping` ends the requests in flight; `executor` (the caller's) prepares
    the engine's requests, `tokenize_executor` serves /tokenize and /detokenize (with a tokenizer of
    their own), so that an open route never queues work in front of the engine's requests."""
    model = engine.config.model_config.model
    models = ServedModels(args.served_model_names or (model,), model, engine.limits.max_model_len)
    as_ids = args.return_tokens_as_token_ids
    completions = OpenAIServingCompletion(engine, models, stopping, executor, as_ids)
    chat = OpenAIServingChat(engine, models, stopping, executor, as_ids, args.auto_tool_parser)
    tokenization = OpenAIServingTokenization(engine, models, stopping, tokenize_executor)
    embeddings = OpenAIServingEmbedding(engine, models, stopping, executor)

    app = FastAPI(title="llmserve", version=__version__, responses=ERROR_RESPONSES)
    install_error_handlers(app)
    if engine.limits.runner == "generate":
        grammars.prepare(engine.tokenizer)  # the first structured request need not wait for it
    app.add_middleware(
        RequestBodyLimitMiddleware, max_bytes=args.max_request_body_bytes, timeout=args.request_body_timeout
    )
    if args.api_key is not None:
        also = ("/tokenize", "/detokenize") if args.tokenize_needs_api_key else ()
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, also_guarded=also)
    app.add_middleware(RequestIdEchoMiddleware)  # outermost: errors of the others carry it too

    @app.get("/health", response_class=Response, responses={200: {"description": "Alive (no body)."}})
    async def health() -> Response:
        if engine.errored:
            return engine_dead().response()
        dead_ranks = engine.engine_core.dead_ranks
        if dead_ranks:  # the others still serve, but the server is not whole: a router should know
            return engine_dead(EngineDeadError(" ".join(dead_ranks.values()))).response()
        # A stopped or wedged core: its requests wait with no error, so only /health can tell. 200 again
        # once it is heard from.
        silent = engine.engine_core.unresponsive_ranks(args.engine_heartbeat_timeout)
        if silent:
            return engine_dead(EngineDeadError(" ".join(silent.values()))).response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def render_metrics() -> Response:
        core = engine.engine_core
        for rank in range(core.num_engines) if not engine.errored else ():
            if rank in core.dead_ranks:
                continue
            with contextlib.suppress(EngineDeadError, TimeoutError):
                stats = await asyncio.wait_for(
                    core.get_scheduler_stats_async(rank), SCHEDULER_STATS_TIMEOUT_SECONDS
                )
                if not engine.errored and rank not in core.dead_ranks:  # not after its gauges were zeroed
                    metrics.record(stats, IterationStats(), rank)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return models.list()

    @app.get("/v1/models/{name:path}")
    async def retrieve_model(name: str) -> ModelCard:
        return models.card(name)

    @app.post("/v1/completions", response_model=None, responses=json_or_events(CompletionResponse))
    async def create_completion(
        request: CompletionRequest, raw_request: Request
    ) -> CompletionResponse | EventStreamResponse:
        request = with_header_rank(with_header_id(request, raw_request.headers), raw_request.headers)
        await completions.check_constraint(request)
        if request.stream:
            return EventStreamResponse(
                await completions.run_blocking(partial(completions.create_stream, request))
            )
        return await cancel_on_disconnect(raw_request, completions.create(request))

    @app.post("/v1/chat/completions", response_model=None, responses=json_or_events(ChatCompletionResponse))
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> ChatCompletionResponse | EventStreamResponse:
        request = with_header_rank(with_header_id(request, raw_request.headers), raw_request.headers)
        await chat.check_constraint(request)
        if request.stream:
            return EventStreamResponse(await chat.run_blocking(partial(chat.create_stream, request)))
        return await cancel_on_disconnect(raw_request, chat.create(request))

    # Answered as JSON built in the executor too: millions of token ids take seconds to serialize.
    @app.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        body = await cancel_on_disconnect(raw_request, embeddings.create(request))
        return Response(body, media_type="application/json")

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(request: TokenizeRequest) -> Response:
        body = await tokenization.run_blocking(lambda: tokenization.tokenize(request).model_dump_json())
        return Response(body, media_type="application/json")

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(request: DetokenizeRequest) -> Response:
        body = await tokenization.run_blocking(lambda: tokenization.detokenize(request).model_dump_json())
        return Response(body, media_type="application/json")

    grammar = engine.config.structured_outputs_config

    def limits() -> Limits:
        text, alternatives = (
            {"maxLength": grammar.max_grammar_bytes},
            {"maxItems": grammar.max_grammar_alternatives},
        )
        return {
            "TokenizeRequest": {"prompt": {"maxLength": tokenization.max_prompt_chars}},
            "DetokenizeRequest": {"tokens": {"maxItems": engine.limits.max_model_len}},
            "StructuredOutputsRequest": {
                "regex": text,
                "grammar": text,
                "whitespace_pattern": text,
                "choice": alternatives,
            },
        }

    publish_limits(app, limits)
    if not args.disable_playground:
        mount_playground(app)
    return app


async def serve(engine_args: EngineArgs, args: ServerArgs) -> None:
    """Load the engine, serve until a signal, then stop: running requests get `SHUTDOWN_GRACE_SECONDS`
    to finish before they are ended, and the engine core process is shut down last."""
    names = args.served_model_names or (engine_args.model,)
    metrics = PrometheusStatLogger(names[0], num_engines=engine_args.data_parallel_size)
    engine = AsyncLLM.from_engine_args(
        engine_args,
        log_requests=args.enable_log_requests,
        log_stats=not args.disable_log_stats,
        stat_loggers=[metrics],
        max_num_queued_requests=args.max_num_queued_requests,
        max_num_queued_tokens=args.max_num_queued_tokens,
    )
    stopping = asyncio.Event()
    executor = ThreadPoolExecutor(1, thread_name_prefix="llmserve-prepare")
    tokenize_executor = ThreadPoolExecutor(1, thread_name_prefix="llmserve-tokenize")
    try:
        app = build_app(engine, args, metrics, stopping, executor, tokenize_executor)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            http=head_timeout_protocol(args.request_header_timeout),
            # a backstop: by then `stopping` has ended every request
            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS + 5,
        )
        await _Server(config, stopping, SHUTDOWN_GRACE_SECONDS).serve()
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        tokenize_executor.shutdown(wait=False, cancel_futures=True)
        engine.shutdown()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt()


def run_server(engine_args: EngineArgs, args: ServerArgs) -> None:
    """`llmserve serve`. SIGTERM ends it like SIGINT: uvicorn catches both while serving, and re-raises
    them once it has stopped, which unwinds through `serve`'s cleanup."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    signal.signal(signal.SIGTERM, _interrupt)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(engine_args, args))
