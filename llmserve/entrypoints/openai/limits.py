"""Limits on what one client can make the server hold or wait for: the size of a request body, the time
to send it, and the time to send a request's head (request line and headers).

The body limit is enforced before any route runs, so a 50 MB body costs at most `max_body_bytes` of
memory and is answered without being read to its end. Uvicorn has no timeout on an incomplete head (its
keep-alive timer only runs between requests), so the connection protocol below adds one."""

from __future__ import annotations

import asyncio
import ctypes
import functools
from collections.abc import Callable

import h11
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmserve.entrypoints.openai.errors import OpenAIError

# A body this large leaves megabytes of freed heap behind once answered (its bytes, its parsed JSON, what
# the route built from it), which glibc keeps for reuse rather than returning it: trimmed after such a
# request, the process's resident memory goes back to what it was.
TRIM_AFTER_BODY_BYTES = 1 << 20


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`; None under another C library."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_heap() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        f"The request body is larger than the server's limit of {limit} bytes.",
        status=413,
        code="request_too_large",
    )


def body_timeout(seconds: float) -> OpenAIError:
    return OpenAIError(
        f"The request body did not arrive within {seconds:g} seconds.", status=408, code="request_timeout"
    )


class RequestBodyLimitMiddleware:
    """Reads each HTTP request's body before the app sees it: answers 413 as soon as the declared
    `Content-Length`, or the bytes received so far (chunked bodies), pass `max_bytes`, and 408 when the
    whole body has not arrived `timeout` seconds after the head. Either answer closes the connection.
    After a large body's request, the heap it freed goes back to the system.
    The app then gets the body as one message, and the server's later messages (the disconnect) as
    usual. Plain ASGI, so that client disconnects stay visible."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(body_too_large(self.max_bytes), scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.timeout):
                first = await self._read_body(receive)
        except TimeoutError:
            await self._refuse(body_timeout(self.timeout), scope, receive, send)
            return
        if first is None:
            await self._refuse(body_too_large(self.max_bytes), scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        await self.app(scope, replay, send)
        if len(first.get("body", b"")) > TRIM_AFTER_BODY_BYTES:
            await asyncio.to_thread(release_freed_heap)

    async def _read_body(self, receive: Receive) -> Message | None:
        """The whole body as one `http.request` message (or the disconnect that cut it short); None
        once it passes the limit."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    @staticmethod
    async def _refuse(error: OpenAIError, scope: Scope, receive: Receive, send: Send) -> None:
        response = error.response()
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def head_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """Uvicorn's h11 protocol, closing any connection whose next request head is still incomplete
    `seconds` after the connection opened or the head's first byte arrived (slowloris). Between
    requests, uvicorn's own keep-alive timeout applies."""

    class HeadTimeoutProtocol(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                if self.head_timer is None:
                    self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self.head_timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _expire(self) -> None:
            self.head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.info("Closing a connection whose request head took over %gs.", seconds)
                self.transport.close()

    return HeadTimeoutProtocol
