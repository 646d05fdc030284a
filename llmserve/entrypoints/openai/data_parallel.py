"""vLLM's `X-data-parallel-rank` header: a client (or a router that keeps a session on one rank, for its
prefix cache) names the data-parallel rank that must serve the request."""

from __future__ import annotations

import re
from typing import TypeVar

from starlette.datastructures import Headers

from llmserve.entrypoints.openai.errors import OpenAIError
from llmserve.entrypoints.openai.protocol import SamplingRequest

RANK_HEADER = "X-data-parallel-rank"

R = TypeVar("R", bound=SamplingRequest)


def with_header_rank(request: R, headers: Headers) -> R:
    """`request` pinned to the header's rank, where it has one (its range is checked with the prompt)."""
    value = headers.get(RANK_HEADER)
    if value is None:
        return request
    if not re.fullmatch(r"\s*[0-9]{1,9}\s*", value):
        raise OpenAIError(
            f"The {RANK_HEADER} header must be a rank number, got {value!r}.", param=RANK_HEADER
        )
    return request.model_copy(update={"data_parallel_rank": int(value)})
