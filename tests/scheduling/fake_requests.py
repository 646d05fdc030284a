"""Requests without a model, for scheduler tests."""

from __future__ import annotations

from llmserve.sampling_params import SamplingParams
from llmserve.scheduling.request import Request


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int = 8,
    priority: int = 0,
    arrival_time: float = 0.0,
) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(
        request_id,
        list(range(1, num_prompt_tokens + 1)),
        params,
        0,
        arrival_time,
        max_model_len=4096,
        priority=priority,
    )
