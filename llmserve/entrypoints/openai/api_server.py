"""The HTTP server: routes on one `AsyncLLM`, the API key check, and the process's life from the first
request to a clean exit on SIGINT / SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from llmserve import __version__
from llmserve.config import EngineArgs
from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.core_proc import LOG_FORMAT
from llmserve.engine.exceptions import EngineDeadError
from llmserve.entrypoints.openai.disconnect import cancel_on_disconnect
from llmserve.entrypoints.openai.errors import OpenAIError, engine_dead, install_error_handlers
from llmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
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
from llmserve.entrypoints.openai.serving_models import ServedModels
from llmserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from llmserve.entrypoints.openai.streaming import EventStreamResponse
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.metrics.stats import IterationStats
from llmserve.model_executor.cpu_threads import configure_front_end_threads

logger = logging.getLogger("llmserve")

# On shutdown, requests still running after this long are ended (which aborts them).
SHUTDOWN_GRACE_SECONDS = 5
# /metrics asks the core for its current queue and KV numbers (it sends none while idle), briefly.
SCHEDULER_STATS_TIMEOUT_SECONDS = 1.0


class ApiKeyMiddleware:
    """`/v1/*` needs `Authorization: Bearer <key>`; the rest (health, metrics, tokenize) stays open.
    Plain ASGI, not Starlette's `BaseHTTPMiddleware`, which would hide client disconnects."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] != "OPTIONS":
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
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
    engine: AsyncLLM, args: ServerArgs, metrics: PrometheusStatLogger, stopping: asyncio.Event
) -> FastAPI:
    """The routes on `engine`, which the caller owns (and shuts down); `metrics` must be one of its
    stat loggers; setting `stopping` ends the requests in flight."""
    model = engine.config.model_config.model
    models = ServedModels(args.served_model_names or (model,), model, engine.limits.max_model_len)
    completions = OpenAIServingCompletion(engine, models, stopping)
    chat = OpenAIServingChat(engine, models, stopping)
    tokenization = OpenAIServingTokenization(engine, models, stopping)

    app = FastAPI(title="llmserve", version=__version__)
    install_error_handlers(app)
    if args.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return engine_dead().response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics")
    async def render_metrics() -> Response:
        if not engine.errored:
            with contextlib.suppress(EngineDeadError, TimeoutError):
                stats = await asyncio.wait_for(
                    engine.engine_core.get_scheduler_stats_async(), SCHEDULER_STATS_TIMEOUT_SECONDS
                )
                metrics.record(stats, IterationStats())
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return models.list()

    @app.get("/v1/models/{name:path}")
    async def retrieve_model(name: str) -> ModelCard:
        return models.card(name)

    @app.post("/v1/completions", response_model=None)
    async def create_completion(
        request: CompletionRequest, raw_request: Request
    ) -> CompletionResponse | EventStreamResponse:
        if request.stream:
            return EventStreamResponse(completions.create_stream(request))
        return await cancel_on_disconnect(raw_request, completions.create(request))

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> ChatCompletionResponse | EventStreamResponse:
        if request.stream:
            return EventStreamResponse(chat.create_stream(request))
        return await cancel_on_disconnect(raw_request, chat.create(request))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return tokenization.detokenize(request)

    return app


async def serve(engine_args: EngineArgs, args: ServerArgs) -> None:
    """Load the engine, serve until a signal, then stop: running requests get `SHUTDOWN_GRACE_SECONDS`
    to finish before they are ended, and the engine core process is shut down last."""
    names = args.served_model_names or (engine_args.model,)
    metrics = PrometheusStatLogger(names[0])
    engine = AsyncLLM.from_engine_args(
        engine_args,
        log_requests=args.enable_log_requests,
        log_stats=not args.disable_log_stats,
        stat_loggers=[metrics],
    )
    stopping = asyncio.Event()
    try:
        app = build_app(engine, args, metrics, stopping)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            # a backstop: by then `stopping` has ended every request
            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS + 5,
        )
        await _Server(config, stopping, SHUTDOWN_GRACE_SECONDS).serve()
    finally:
        engine.shutdown()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt()


def run_server(engine_args: EngineArgs, args: ServerArgs) -> None:
    """`llmserve serve`. SIGTERM ends it like SIGINT: uvicorn catches both while serving, and re-raises
    them once it has stopped, which unwinds through `serve`'s cleanup."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    signal.signal(signal.SIGTERM, _interrupt)
    if engine_args.multiprocess:
        configure_front_end_threads()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(engine_args, args))
