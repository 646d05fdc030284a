"""What the model runner keeps of each request between steps, built from the scheduler's data alone.

The scheduler sends a request's parameters once (`NewRequestData`, again after a preemption) and then
only ids, positions and tokens; the runner appends the tokens it samples and keeps, so that the logits
processors read the request's whole history (penalties, bad words, min_tokens) without the scheduler's
`Request`. A stopped request's last tokens differ from what the runner appended only once it finished,
and then the runner drops it.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.contracts import NewRequestData
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams


@dataclass(eq=False)  # hashed by identity: the compiled logits processing is cached per state (weakly)
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    bad_words_token_ids: list[list[int]] | None
    pooling_params: PoolingParams | None
    all_token_ids: list[int]  # the prompt, then every output token so far
    num_prompt_logprobs: int  # prompt positions already scored

    @classmethod
    def from_new(cls, data: NewRequestData) -> CachedRequestState:
        return cls(
            data.request_id,
            data.prompt_token_ids,
            data.sampling_params,
            data.eos_token_id,
            data.bad_words_token_ids,
            data.pooling_params,
            data.prompt_token_ids + data.output_token_ids,
            data.num_prompt_logprobs,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]
