"""Non-streaming requests run until their client leaves: then they are cancelled, which aborts their
engine requests and frees their KV blocks instead of generating for nobody."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

from llmserve.entrypoints.openai.errors import ClientGone

T = TypeVar("T")


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message the server sends is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`await work`, unless the client disconnects first: then `work` is cancelled and `ClientGone`
    raised."""
    task = asyncio.create_task(work)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()
