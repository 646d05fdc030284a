"""Server-Sent Events as OpenAI sends them, and the plumbing that makes a stream's end (finished, client
gone, server stopping) close every engine stream behind it, which aborts their requests at once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Sequence
from typing import TypeVar

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from llmserve.engine.exceptions import EngineDeadError
from llmserve.entrypoints.openai.errors import OpenAIError, engine_dead, internal_error

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def error_event(error: Exception) -> str:
    """An error after the 200 went out: OpenAI clients raise `APIError` on a chunk holding `error`."""
    if isinstance(error, EngineDeadError):
        error = engine_dead(error)
    elif not isinstance(error, OpenAIError):
        error = internal_error(error, "an event stream")
    return f"data: {json.dumps(error.body())}\n\n"


class EventStreamResponse(StreamingResponse):
    """Closes its event generator however the response ends. Starlette only stops iterating when the
    client leaves; without the close, the engine requests would run on until garbage collection."""

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


async def _next(stream: AsyncGenerator[T, None]) -> T:
    return await anext(stream)


async def merge_streams(
    streams: Sequence[AsyncGenerator[T, None]], stop: asyncio.Event
) -> AsyncGenerator[tuple[int, T], None]:
    """The items of several streams as they come, each with its stream's index. Closing the merged
    stream, or cancelling its consumer, closes every source; so does an error in one of them, or `stop`
    (the server is shutting down), which raises a 503 `OpenAIError`."""
    pending = {asyncio.create_task(_next(s)): i for i, s in enumerate(streams)}
    stopping = asyncio.create_task(stop.wait())
    try:
        while pending:
            done, _ = await asyncio.wait([*pending, stopping], return_when=asyncio.FIRST_COMPLETED)
            if stopping in done:
                raise OpenAIError("The server is shutting down.", status=503, type="server_error")
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.create_task(_next(streams[i]))] = i
                yield i, item
    finally:
        stopping.cancel()
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
