"""Logits → next tokens for a batch in which every row has its own sampling settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmserve.contracts import TokenLogprobs


@dataclass
class SamplingMetadata:
    """Per-row settings as tensors. A filter's tensor is None when no row uses it."""

    temperature: torch.Tensor  # [batch] fp32; 0 marks a greedy row
    all_greedy: bool
    top_k: torch.Tensor | None  # [batch] int64; vocab size where disabled
    top_p: torch.Tensor | None  # [batch] fp32; 1 where disabled
    min_p: torch.Tensor | None  # [batch] fp32; 0 where disabled
    generators: dict[int, torch.Generator]  # row → its request's seeded generator


Argmax = Callable[[torch.Tensor], torch.Tensor]  # [rows, n] -> [rows] int64, as torch.argmax(dim=-1)


def torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, meta: SamplingMetadata, argmax: Argmax = torch_argmax) -> torch.Tensor:
    """logits [batch, vocab] fp32, after `apply_logits_processors` → token ids [batch] int64.

    Temperature, then min-p, then top-k and top-p; greedy rows take the argmax of the given logits.
    `argmax` is the execution plan's (the C kernel on the CPU).
    """
    greedy = argmax(logits)
    if meta.all_greedy:
        return greedy
    # A temperature past fp32's range (1e39) is inf here, and -inf / inf is NaN: masked tokens would
    # come back. The largest finite temperature samples uniformly over the unmasked ones, as it should.
    temperature = torch.where(meta.temperature > 0, meta.temperature, 1.0).clamp(
        max=torch.finfo(torch.float32).max
    )
    logits = logits / temperature.unsqueeze(1)
    if meta.min_p is not None:
        logits = _apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        logits = _apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)
    random = _exponential_race(probs, meta.generators, argmax)
    return torch.where(meta.temperature > 0, random, greedy)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask all but the top-k tokens, then all but the smallest set whose mass reaches top-p."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _exponential_race(
    probs: torch.Tensor, generators: dict[int, torch.Generator], argmax: Argmax
) -> torch.Tensor:
    """Sample each row as argmax(p / E) with E ~ Exp(1), which draws from p exactly.

    Rows of seeded requests draw E from their own generator, one row of draws per row in order (see
    `skip_draws`), so their samples do not depend on what else is in the batch.
    """
    noise = torch.empty_like(probs).exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return argmax(probs / noise)


def skip_draws(generator: torch.Generator, num_rows: int, vocab: int) -> None:
    """Advance `generator` past `num_rows` rows of `_exponential_race`'s draws, exactly as sampling them
    does."""
    for _ in range(num_rows):
        torch.empty(vocab, dtype=torch.float32, device=generator.device).exponential_(generator=generator)


def gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int]
) -> list[TokenLogprobs]:
    """Per row: the raw logprob and rank of `token_ids[row]` (the sampled or the prompt token), then
    the top-k (k per row). Computed from unprocessed logits, as vLLM documents, and only for these rows.
    """
    logprobs = logits.float().log_softmax(dim=-1)  # [rows, vocab]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(max(num_logprobs), dim=-1)
    # One transfer per tensor; the per-row lists are then cut from Python lists.
    ids, chosen_values, chosen_ranks = token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist()
    top_value_rows, top_id_rows = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(
            token_ids=[ids[row], *top_id_rows[row][:k]],
            logprobs=[chosen_values[row], *top_value_rows[row][:k]],
            ranks=[chosen_ranks[row], *range(1, k + 1)],
        )
        for row, k in enumerate(num_logprobs)
    ]
