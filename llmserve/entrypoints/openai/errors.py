"""Every failure leaves the server as OpenAI's error body, `{"error": {message, type, param, code}}`, so
that OpenAI clients raise their usual exception types (BadRequestError, NotFoundError, ...)."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.engine.exceptions import EngineDeadError

logger = logging.getLogger("llmserve")

# Status code of a request whose client left before the answer (nginx's convention; nobody reads it).
CLIENT_CLOSED_REQUEST = 499


class OpenAIError(Exception):
    """An error the client caused or must learn about, with OpenAI's fields."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def body(self) -> dict[str, dict[str, Any]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorInfo(BaseModel):
    """`OpenAIError.body()`'s inner object, as /openapi.json documents every 4xx and 5xx."""

    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    error: ErrorInfo


class ClientGone(Exception):
    """The client disconnected while its request ran; the request has been aborted."""


def bad_request(error: ValueError, fields: Iterable[str], fallback: str | None = None) -> OpenAIError:
    """A 400 from an engine `ValueError`. Those messages start with the offending field's name, which
    becomes `param` when it is one of the request's `fields`; otherwise `fallback` is named."""
    message = str(error)
    first_word = re.match(r"\w+", message)
    param = first_word.group(0) if first_word and first_word.group(0) in set(fields) else fallback
    return OpenAIError(message, param=param)


def internal_error(error: BaseException, where: str) -> OpenAIError:
    """A 500 that names a fresh request id and nothing else: the exception's text can hold prompts,
    paths or keys. The traceback goes to the server's log under the same id."""
    request_id = f"req-{uuid.uuid4().hex}"
    logger.error("Internal server error (request id %s) in %s", request_id, where, exc_info=error)
    return OpenAIError(f"Internal server error (request id {request_id}).", status=500, type="server_error")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found"
    )


def engine_dead(error: BaseException | None = None) -> OpenAIError:
    message = str(error) if error is not None and str(error) else "The engine is dead."
    return OpenAIError(message, status=503, type="server_error")


# What pydantic adds to an error's location to say which member of a union failed: not a field.
_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _param_of(loc: tuple[int | str, ...]) -> str | None:
    """("body", "messages", 0, "role") → "messages[0].role", OpenAI's spelling of a nested parameter."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, str) and (part in _UNION_TAGS or "[" in part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _validation_error(error: RequestValidationError) -> OpenAIError:
    first = error.errors()[0]
    param = _param_of(tuple(first.get("loc", ())))
    kind = first.get("type")
    if kind == "json_invalid":
        return OpenAIError(f"The request body is not valid JSON: {first.get('msg')}.")
    if param is None:
        return OpenAIError("The request body must be a JSON object.")
    if kind == "missing":
        return OpenAIError(f"Missing required parameter: '{param}'.", param=param)
    if kind == "extra_forbidden":
        return OpenAIError(f"Unrecognized request argument supplied: {param}", param=param)
    reason = first.get("ctx", {}).get("error") if kind == "value_error" else None
    return OpenAIError(f"Invalid value for '{param}': {reason or first.get('msg')}", param=param)


async def _on_openai_error(_: Request, error: Exception) -> Response:
    assert isinstance(error, OpenAIError)  # registered for this type only
    return error.response()


async def _on_validation_error(_: Request, error: Exception) -> Response:
    assert isinstance(error, RequestValidationError)
    return _validation_error(error).response()


async def _on_http_error(_: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    response = OpenAIError(str(error.detail), status=error.status_code, type=kind).response()
    response.headers.update(error.headers or {})  # a 405's `Allow` (RFC 9110 requires it)
    return response


async def _on_engine_dead(_: Request, error: Exception) -> Response:
    return engine_dead(error).response()


async def _on_client_gone(_: Request, __: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


class UnexpectedErrorMiddleware:
    """Whatever a route raises that no handler maps (a `RecursionError`, a `MemoryError`, a bug) is a
    500 naming a request id, logged once with its traceback under that id. Starlette's catch-all would
    answer the same, then re-raise for the server to log the traceback again, without the id. An error
    after the response started (a stream) is logged, and the connection ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as e:  # noqa: BLE001 (each one is answered and logged)
            error = internal_error(e, f"{scope['method']} {scope['path']}")
            if not started:
                await error.response()(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(EngineDeadError, _on_engine_dead)
    app.add_exception_handler(ClientGone, _on_client_gone)
    app.add_middleware(UnexpectedErrorMiddleware)  # the first added: innermost of the middleware
