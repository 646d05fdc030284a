"""`RequestOutputCollector`: the hand-off between the output handler and one `generate()` stream."""

from __future__ import annotations

import asyncio

from llmserve.outputs import AnyRequestOutput, RequestOutput
from llmserve.sampling_params import RequestOutputKind


class RequestOutputCollector:
    """Holds at most one pending output. `put` never blocks: when the consumer lags, a newer output is
    folded into the pending one (DELTA outputs concatenated, others replaced), so nothing is lost and
    memory stays bounded. An exception put here is raised by the next `get`. A pooling request's
    collector receives its one `PoolingRequestOutput`.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self._pending: AnyRequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: AnyRequestOutput | BaseException) -> None:
        if isinstance(self._pending, RequestOutput) and isinstance(output, RequestOutput):
            self._pending.add(output, aggregate=self.aggregate)
        elif not isinstance(self._pending, BaseException):
            self._pending = output
        self._ready.set()

    async def get(self) -> AnyRequestOutput:
        while self._pending is None:
            await self._ready.wait()
        return self._take()

    def get_nowait(self) -> AnyRequestOutput | None:
        return None if self._pending is None else self._take()

    def _take(self) -> AnyRequestOutput:
        output, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(output, BaseException):
            raise output
        assert output is not None
        return output
