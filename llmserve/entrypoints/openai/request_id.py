"""The ids clients give their requests, as vLLM takes them: the `X-Request-Id` header, else the body's
`request_id`, names the response (`chatcmpl-<id>`, `cmpl-<id>`); and the header comes back on the
response, so that a client or a proxy can match the two (vLLM's `--enable-request-id-headers` sends a
fresh one when the client sent none; we send back only the client's)."""

from __future__ import annotations

from typing import TypeVar

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.entrypoints.openai.errors import OpenAIError
from llmserve.entrypoints.openai.protocol import MAX_REQUEST_ID_CHARS, SamplingRequest

HEADER = "x-request-id"  # ASGI servers hand header names over in lower case

R = TypeVar("R", bound=SamplingRequest)


def with_header_id(request: R, headers: Headers) -> R:
    """`request` with the header's id, which takes precedence over the body's `request_id` (vLLM's)."""
    value = headers.get(HEADER)
    if value is None:
        return request
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise OpenAIError(
            f"The X-Request-Id header must be at most {MAX_REQUEST_ID_CHARS} characters long.",
            param="X-Request-Id",
        )
    return request.model_copy(update={"request_id": value})


class RequestIdEchoMiddleware:
    """Every response to a request with an `X-Request-Id` header carries that header back, as sent.
    Plain ASGI, like the server's other middleware, so that streaming and disconnects pass through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        value = next((v for k, v in scope.get("headers", ()) if k == HEADER.encode()), None)
        if scope["type"] != "http" or value is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER.encode(), value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
