"""What the front end measures per step and per finished request, for log lines and /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """Counts for one batch of engine core outputs."""

    num_prompt_tokens: int = 0  # prompts whose first token arrived in this batch
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
