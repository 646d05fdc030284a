"""Overload control in the front end: how many requests, and how many prompt tokens, wait for their first
output, and the errors a request gets when the queue is full or it waited too long in the core."""

from __future__ import annotations

from collections.abc import Iterable

from llmserve.contracts import EngineCoreRequest


class EngineOverloadedError(Exception):
    """The engine cannot take or finish this request now; the client may retry later (a 503)."""


class QueueFullError(EngineOverloadedError):
    """Admitting the request would take the queue past `max_num_queued_requests` or
    `max_num_queued_tokens`; nothing of it reached the core."""


class QueueTimeoutError(EngineOverloadedError):
    """The request waited in the core's queue longer than `max_queue_time` and ended unrun."""


class QueueLimits:
    """Tracks the "queued" engine requests: submitted, and without any output yet (n > 1 counts each
    sample's request, each with the whole prompt). Every path out of the queue calls `release`: the
    first output (or a finish without one), an abort, the engine's death. None means no limit. A
    request that finds the queue empty is always admitted, so that one longer than the token limit
    is not refused forever.
    """

    def __init__(self, max_num_queued_requests: int | None, max_num_queued_tokens: int | None) -> None:
        for name, value in (
            ("max_num_queued_requests", max_num_queued_requests),
            ("max_num_queued_tokens", max_num_queued_tokens),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        self.max_requests = max_num_queued_requests
        self.max_tokens = max_num_queued_tokens
        self._queued: dict[str, int] = {}  # core request id → its prompt tokens
        self.num_tokens = 0

    @property
    def num_requests(self) -> int:
        return len(self._queued)

    def __bool__(self) -> bool:
        return bool(self._queued)

    def check(self, num_requests: int, num_tokens: int) -> None:
        """Raises `QueueFullError` if that many more requests and tokens would pass a limit."""
        if not self._queued:
            return
        if self.max_requests is not None and self.num_requests + num_requests > self.max_requests:
            raise QueueFullError(
                f"The server is overloaded: {self.num_requests} requests are queued, and the limit is "
                f"{self.max_requests} (max_num_queued_requests). Retry later."
            )
        if self.max_tokens is not None and self.num_tokens + num_tokens > self.max_tokens:
            raise QueueFullError(
                f"The server is overloaded: {self.num_tokens} prompt tokens are queued, and this request "
                f"adds {num_tokens} past the limit of {self.max_tokens} (max_num_queued_tokens). Retry later."
            )

    def admit(self, requests: list[EngineCoreRequest]) -> None:
        """All of them or none: raises `QueueFullError` when they do not fit."""
        tokens = [len(r.prompt_token_ids) for r in requests]
        self.check(len(requests), sum(tokens))
        for request, n in zip(requests, tokens):
            self._queued[request.request_id] = n
            self.num_tokens += n

    def release(self, request_ids: Iterable[str]) -> None:
        """Ids that are not queued (any more) are ignored."""
        for request_id in request_ids:
            n = self._queued.pop(request_id, None)
            if n is not None:
                self.num_tokens -= n

    def clear(self) -> None:
        self._queued.clear()
        self.num_tokens = 0
