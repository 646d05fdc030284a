"""The front end's state of one pooling (embedding) request: no detokenizer, no stop strings, one output."""

from __future__ import annotations

import numpy as np

from llmserve.contracts import EngineCoreOutput, EngineCoreRequest, FinishReason
from llmserve.metrics.stats import FinishedRequestStats, IterationStats
from llmserve.outputs import OutputSink, PoolingOutput, PoolingRequestOutput, RequestMetrics


class PoolingRequestState:
    """From submission to the core's one output for the request, which carries its vector."""

    parent = None  # a pooling request is never fanned out

    def __init__(self, request: EngineCoreRequest, sink: OutputSink | None) -> None:
        self.request_id = request.request_id
        self.sink = sink
        self.prompt_token_ids = request.prompt_token_ids
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self.finish_reason: FinishReason | None = None
        self.vector: bytes | None = None

    @property
    def external_id(self) -> str:
        return self.request_id

    def update(self, output: EngineCoreOutput, now: float, stats: IterationStats) -> bool:
        """Absorb the core's output; False: no stop string ends a pooling request."""
        self.finish_reason, self.vector = output.finish_reason, output.pooling_output
        self.metrics.first_token_time = self.metrics.finished_time = now
        stats.num_prompt_tokens += len(self.prompt_token_ids)
        if self.finish_reason is not None:
            e2e = now - self.metrics.arrival_time
            stats.finished_requests.append(
                FinishedRequestStats(str(self.finish_reason), e2e, len(self.prompt_token_ids), 0)
            )
        return False

    def make_output(self) -> PoolingRequestOutput[PoolingOutput] | None:
        if self.vector is None:
            return None
        # here, not at the top: the front end loads torch only once a pooling request returns a tensor
        import torch

        data = torch.from_numpy(np.frombuffer(self.vector, dtype="<f4").copy())
        return PoolingRequestOutput(self.request_id, PoolingOutput(data), self.prompt_token_ids, True)
