"""Pooling: one vector per prompt from its hidden states, for embeddings (the pooling runner).

The batch is ragged: each prompt is a span of rows of the flat hidden states, and no row is padding.
MEAN averages a prompt's rows, CLS takes its first, LAST its last (vLLM's pooling types); the vector
is then L2-normalised if the request (or, by default, the model) asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

PoolingType = Literal["MEAN", "CLS", "LAST"]


@dataclass(frozen=True)
class PoolerConfig:
    """How a model pools (vLLM's names): from its sentence-transformers modules where it has them,
    else the architecture's default (LAST and normalised for decoders, as vLLM's embed runner)."""

    pooling_type: PoolingType
    normalize: bool

    def __post_init__(self) -> None:
        if self.pooling_type not in get_args(PoolingType):
            choices = ", ".join(get_args(PoolingType))
            raise ValueError(f"pooling_type must be one of {choices}, got {self.pooling_type!r}.")

    @property
    def needs_whole_prompt(self) -> bool:
        """MEAN and CLS read every row (or the first) of a prompt: it must be computed in one step.
        LAST reads only the row computed last, after the prompt's other chunks."""
        return self.pooling_type != "LAST"


@dataclass(frozen=True)
class PoolingSpan:
    """A prompt's rows `[start, start + length)` of the flat hidden states; `normalize` as the
    request asked (None: the model's default)."""

    start: int
    length: int
    normalize: bool | None = None


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

    def __call__(self, hidden: torch.Tensor, spans: list[PoolingSpan]) -> torch.Tensor:
        """hidden [num_tokens, hidden_size] → float32 [len(spans), hidden_size]."""
        device = hidden.device
        starts = torch.tensor([s.start for s in spans], device=device)
        lengths = torch.tensor([s.length for s in spans], device=device)
        kind = self.config.pooling_type
        if kind == "CLS":
            pooled = hidden[starts].float()
        elif kind == "LAST":
            pooled = hidden[starts + lengths - 1].float()
        else:
            pooled = _mean(hidden, starts, lengths)
        wanted = [self.config.normalize if s.normalize is None else s.normalize for s in spans]
        if all(wanted):
            return F.normalize(pooled, p=2, dim=-1)
        if any(wanted):
            rows = torch.tensor(wanted, device=device)
            pooled[rows] = F.normalize(pooled[rows], p=2, dim=-1)
        return pooled


def _mean(hidden: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each span's average row, summed in float32: [num_spans, hidden_size]."""
    segment = torch.repeat_interleave(torch.arange(len(starts), device=hidden.device), lengths)
    offsets = torch.arange(len(segment), device=hidden.device) - (lengths.cumsum(0) - lengths)[segment]
    rows = hidden[starts[segment] + offsets].float()
    sums = torch.zeros(len(starts), hidden.shape[-1], device=hidden.device).index_add_(0, segment, rows)
    return sums / lengths[:, None]


def vector_bytes(vectors: torch.Tensor) -> list[bytes]:
    """Each row [n, hidden] as float32 little-endian bytes: what an `EngineCoreOutput` carries."""
    rows = vectors.float().cpu().numpy().astype("<f4", copy=False)
    return [row.tobytes() for row in rows]
