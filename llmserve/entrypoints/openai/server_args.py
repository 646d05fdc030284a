"""The server's own options (the engine's come from `EngineArgs`), and their command-line flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from llmserve.config import option
from llmserve.engine.messages import HEARTBEAT_INTERVAL_S
from llmserve.entrypoints.flags import add_flags, values_from
from llmserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

API_KEY_ENV = "LLMSERVE_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerArgs:
    """The server's options; `llmserve serve`'s flags are generated from these fields (`flags.py`)."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    api_key: str | None = option(
        None,
        f"require this key on /v1/* as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none)",
        env=API_KEY_ENV,
    )
    served_model_names: tuple[str, ...] = option(
        (),
        "the model name(s) clients use; the first is reported (default: the model argument)",
        flag="--served-model-name",
    )
    disable_log_stats: bool = option(False, "no periodic stats log line (/metrics stays on)")
    enable_log_requests: bool = option(False, "log each request's start and end")
    uvicorn_log_level: str = option("info", "uvicorn's log level", choices=LOG_LEVELS)
    # Far above any prompt max_model_len allows (16 MiB is ~4M tokens of English), far below what hurts.
    max_request_body_bytes: int = option(16 << 20, "larger request bodies get a 413 without being read")
    # Whole-body and whole-head deadlines: generous for a slow link, short enough that idle sockets
    # (slowloris) cannot pile up.
    request_body_timeout: float = option(60.0, "seconds a client has to send a request's body, else 408")
    request_header_timeout: float = option(
        10.0, "seconds a client has to send a request's line and headers, else the connection is closed"
    )
    return_tokens_as_token_ids: bool = option(
        False,
        "logprobs name tokens 'token_id:<id>' unless a request's return_tokens_as_token_ids says "
        "otherwise (vLLM's flag)",
    )
    max_num_queued_requests: int | None = option(
        None,
        "requests still waiting for their first output beyond which new ones get a 503 with "
        "Retry-After (default: no limit)",
    )
    max_num_queued_tokens: int | None = option(
        None, "the same for the sum of those requests' prompt tokens (default: no limit)"
    )
    tool_call_parser: str | None = option(
        None,
        "how tool calls are read out of the model's text for tool_choice 'auto' (vLLM's names)",
        choices=TOOL_PARSERS,
    )
    enable_auto_tool_choice: bool = option(
        False,
        "let the model decide when to call tools (tool_choice 'auto', the default with tools); "
        "needs --tool-call-parser",
    )
    disable_playground: bool = option(False, "serve the API alone, without the web page at /")
    tokenize_needs_api_key: bool = option(
        False, "/tokenize and /detokenize need the --api-key too (default: open, as vLLM's)"
    )
    # A stopped core, or one stuck holding the GIL (a busy one still beats). Long enough that a loaded
    # machine's scheduling delays never trip it, short enough to act on.
    engine_heartbeat_timeout: float = option(
        20.0,
        "seconds without a word from an engine core (it sends a heartbeat even mid-step) after which "
        "/health answers 503, until it is heard again",
    )

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
    add_flags(parser, ServerArgs)


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    return ServerArgs(**values_from(ns, ServerArgs))
