"""The server's own options (the engine's come from `EngineArgs`), and their command-line flags."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from llmserve.engine.messages import HEARTBEAT_INTERVAL_S
from llmserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

API_KEY_ENV = "LLMSERVE_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on /v1/*
    served_model_names: tuple[str, ...] = ()  # empty: the model argument
    disable_log_stats: bool = False
    enable_log_requests: bool = False
    uvicorn_log_level: str = "info"
    # Far above any prompt max_model_len allows (16 MiB is ~4M tokens of English), far below what hurts.
    max_request_body_bytes: int = 16 << 20
    # Whole-body and whole-head deadlines: generous for a slow link, short enough that idle sockets
    # (slowloris) cannot pile up.
    request_body_timeout: float = 60.0
    request_header_timeout: float = 10.0
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>" by default
    # Requests without a first output yet, and their prompt tokens, beyond which new ones get a 503
    # with Retry-After (None: no limit).
    max_num_queued_requests: int | None = None
    max_num_queued_tokens: int | None = None
    # vLLM's tool calling flags: `tool_choice: "auto"` reads calls out of the text with this parser
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    disable_playground: bool = False  # no web page at `/`: the API alone
    tokenize_needs_api_key: bool = False  # /tokenize and /detokenize behind --api-key too
    # /health turns 503 once an engine core (any data-parallel rank) has sent nothing, not even its
    # heartbeat, for this long: a stopped core, or one stuck holding the GIL (a busy one still beats).
    # Long enough that a loaded machine's scheduling delays never trip it, short enough to act on.
    engine_heartbeat_timeout: float = 20.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}.")
        if self.api_key == "":
            raise ValueError("api_key must not be empty.")
        if any(not name for name in self.served_model_names):
            raise ValueError("served_model_name must not be empty.")
        if self.uvicorn_log_level not in LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {', '.join(LOG_LEVELS)}.")
        if self.max_request_body_bytes <= 0:
            raise ValueError(f"max_request_body_bytes must be positive, got {self.max_request_body_bytes}.")
        for name in ("request_body_timeout", "request_header_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        for name in ("max_num_queued_requests", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}.")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice requires tool_call_parser (vLLM's rule).")
        if not self.engine_heartbeat_timeout >= 2 * HEARTBEAT_INTERVAL_S:  # NaN fails too
            raise ValueError(
                f"engine_heartbeat_timeout must be at least {2 * HEARTBEAT_INTERVAL_S:g} s (twice the "
                f"engine core's heartbeat interval), got {self.engine_heartbeat_timeout}."
            )

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser `tool_choice: "auto"` uses; None while auto tool choice is off."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None


def add_server_args(parser: argparse.ArgumentParser) -> None:
    d = ServerArgs()
    parser.add_argument("--host", default=d.host, help=f"address to listen on (default: {d.host})")
    parser.add_argument("--port", type=int, default=d.port, help=f"(default: {d.port})")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require this key on /v1/* as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name(s) clients use; the first is reported (default: the model argument)",
    )
    parser.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic stats log line (/metrics stays on)"
    )
    parser.add_argument("--enable-log-requests", action="store_true", help="log each request's start and end")
    parser.add_argument("--uvicorn-log-level", default=d.uvicorn_log_level, choices=LOG_LEVELS)
    parser.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name tokens 'token_id:<id>' unless a request's return_tokens_as_token_ids says "
        "otherwise (vLLM's flag)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=d.max_request_body_bytes,
        help=f"larger request bodies get a 413 without being read (default: {d.max_request_body_bytes})",
    )
    parser.add_argument(
        "--request-body-timeout",
        type=float,
        default=d.request_body_timeout,
        help=f"seconds a client has to send a request's body, else 408 (default: {d.request_body_timeout:g})",
    )
    parser.add_argument(
        "--request-header-timeout",
        type=float,
        default=d.request_header_timeout,
        help="seconds a client has to send a request's line and headers, else the connection is closed "
        f"(default: {d.request_header_timeout:g})",
    )
    parser.add_argument(
        "--max-num-queued-requests",
        type=int,
        default=None,
        help="requests still waiting for their first output beyond which new ones get a 503 with "
        "Retry-After (default: no limit)",
    )
    parser.add_argument(
        "--max-num-queued-tokens",
        type=int,
        default=None,
        help="the same for the sum of those requests' prompt tokens (default: no limit)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how tool calls are read out of the model's text for tool_choice 'auto' (vLLM's names)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let the model decide when to call tools (tool_choice 'auto', the default with tools); "
        "needs --tool-call-parser",
    )
    parser.add_argument(
        "--disable-playground", action="store_true", help="serve the API alone, without the web page at /"
    )
    parser.add_argument(
        "--tokenize-needs-api-key",
        action="store_true",
        help="/tokenize and /detokenize need the --api-key too (default: open, as vLLM's)",
    )
    parser.add_argument(
        "--engine-heartbeat-timeout",
        type=float,
        default=d.engine_heartbeat_timeout,
        help="seconds without a word from an engine core (it sends a heartbeat even mid-step) after which "
        f"/health answers 503, until it is heard again (default: {d.engine_heartbeat_timeout:g})",
    )


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    return ServerArgs(
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key if ns.api_key is not None else os.environ.get(API_KEY_ENV) or None,
        served_model_names=tuple(ns.served_model_name or ()),
        disable_log_stats=ns.disable_log_stats,
        enable_log_requests=ns.enable_log_requests,
        uvicorn_log_level=ns.uvicorn_log_level,
        max_request_body_bytes=ns.max_request_body_bytes,
        request_body_timeout=ns.request_body_timeout,
        request_header_timeout=ns.request_header_timeout,
        return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
        max_num_queued_requests=ns.max_num_queued_requests,
        max_num_queued_tokens=ns.max_num_queued_tokens,
        tool_call_parser=ns.tool_call_parser,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        disable_playground=ns.disable_playground,
        tokenize_needs_api_key=ns.tokenize_needs_api_key,
        engine_heartbeat_timeout=ns.engine_heartbeat_timeout,
    )
