"""Logits processing before sampling, in vLLM's order: masks → min_tokens and logit_bias → penalties.

Temperature, min-p and top-k/top-p follow in the sampler. Each feature's tensors exist only when some
row of the batch uses it, so a batch that uses none pays nothing: `build_logits_metadata` returns None.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from llmserve.sampling_params import SamplingParams
from llmserve.scheduling.request import Request


@dataclass
class Penalties:
    """Penalty settings of the rows that use any, and their tokens as flat (row, token) pairs.

    Rows are indices into `Penalties.rows`' order (0..r-1), not into the batch.
    """

    rows: torch.Tensor  # [r] int64: the batch rows
    repetition: torch.Tensor  # [r] fp32; 1 where unused
    presence: torch.Tensor  # [r] fp32; 0 where unused
    frequency: torch.Tensor  # [r] fp32; 0 where unused
    output_tokens: torch.Tensor  # [2, n] int64: (row, token) for every output token
    prompt_tokens: torch.Tensor | None  # [2, m] int64 (row, token); None when no row has repetition


@dataclass
class LogitsMetadata:
    """What to do to the logits of one step's sampling rows. A None field means no row uses it."""

    allowed_rows: torch.Tensor | None  # [a] int64: rows restricted by allowed_token_ids
    allowed_mask: torch.Tensor | None  # [a, vocab] bool: True where the token may be generated
    banned: torch.Tensor | None  # [2, b] int64 (row, token) set to -inf: bad words, min_tokens stops
    bias_index: torch.Tensor | None  # [2, c] int64 (row, token) that logit_bias moves
    bias_values: torch.Tensor | None  # [c] fp32, already clamped to [-100, 100]
    penalties: Penalties | None


def apply_logits_processors(logits: torch.Tensor, meta: LogitsMetadata) -> torch.Tensor:
    """logits [batch, vocab] fp32 → processed copy (the raw logits stay untouched for logprobs)."""
    logits = logits.clone()
    if meta.allowed_rows is not None and meta.allowed_mask is not None:
        logits[meta.allowed_rows] = logits[meta.allowed_rows].masked_fill(~meta.allowed_mask, float("-inf"))
    if meta.banned is not None:
        logits[meta.banned[0], meta.banned[1]] = float("-inf")
    if meta.bias_index is not None and meta.bias_values is not None:
        logits.index_put_((meta.bias_index[0], meta.bias_index[1]), meta.bias_values, accumulate=True)
    if meta.penalties is not None:
        logits[meta.penalties.rows] = _penalized(logits[meta.penalties.rows], meta.penalties)
    return logits


def _penalized(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition (Hugging Face's: tokens seen in prompt or output), then frequency and presence
    (OpenAI's: `logit - frequency * count - presence * (count > 0)` over the output)."""
    counts = torch.zeros_like(logits)  # [r, vocab]: each token's count in the row's output
    out = p.output_tokens
    counts.index_put_((out[0], out[1]), torch.ones_like(out[0], dtype=logits.dtype), accumulate=True)
    generated = counts > 0
    seen = generated.clone()
    if p.prompt_tokens is not None:
        seen[p.prompt_tokens[0], p.prompt_tokens[1]] = True
    repetition = p.repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    return logits - p.frequency.unsqueeze(1) * counts - p.presence.unsqueeze(1) * generated


def _needs_processing(request: Request) -> bool:
    params = request.sampling_params
    return params.allowed_token_ids is not None or bool(params.logit_bias) or reads_history(request)


def reads_history(request: Request) -> bool:
    """Whether the request's processing at a position depends on the tokens before it: penalties, bad
    words, and min_tokens while unmet. Rows of guessed tokens (spec_decode/) need it not to: they are
    all processed from the request's state before the guesses."""
    params = request.sampling_params
    return (
        bool(request.bad_words_token_ids)
        or request.num_output_tokens < params.min_tokens
        or _uses_penalties(params)
    )


def _uses_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    )


def build_logits_metadata(
    requests: list[Request], vocab_size: int, device: torch.device
) -> LogitsMetadata | None:
    """The step's processing for `requests` (one per sampling row), or None when none uses any."""
    if not any(_needs_processing(r) for r in requests):
        return None
    allowed_rows = [row for row, r in enumerate(requests) if r.sampling_params.allowed_token_ids is not None]
    allowed_mask = None
    if allowed_rows:
        allowed_mask = torch.zeros(len(allowed_rows), vocab_size, dtype=torch.bool)
        for i, row in enumerate(allowed_rows):
            allowed_mask[i, requests[row].sampling_params.allowed_token_ids] = True
    banned = [(row, token) for row, r in enumerate(requests) for token in _banned_tokens(r)]
    bias = [
        (row, token, value)
        for row, r in enumerate(requests)
        for token, value in (r.sampling_params.logit_bias or {}).items()
    ]
    return LogitsMetadata(
        allowed_rows=_long(allowed_rows, device) if allowed_rows else None,
        allowed_mask=None if allowed_mask is None else allowed_mask.to(device),
        banned=_pairs([(row, t) for row, t in banned], device),
        bias_index=_pairs([(row, t) for row, t, _ in bias], device),
        bias_values=torch.tensor([v for *_, v in bias], dtype=torch.float32, device=device) if bias else None,
        penalties=_penalties(requests, device),
    )


def _banned_tokens(request: Request) -> list[int]:
    """EOS and stop tokens until min_tokens is reached; the bad words whose prefix was just generated
    (vLLM compares against the output only)."""
    params = request.sampling_params
    banned: list[int] = []
    num_output = request.num_output_tokens
    if num_output < params.min_tokens:
        banned.extend(params.stop_token_ids or ())
        if request.eos_token_id is not None and not params.ignore_eos:
            banned.append(request.eos_token_id)
    for word in request.bad_words_token_ids or ():
        prefix_len = len(word) - 1
        if prefix_len > num_output:
            continue
        if prefix_len == 0 or request.all_token_ids[-prefix_len:] == word[:-1]:
            banned.append(word[-1])
    return banned


def _penalties(requests: list[Request], device: torch.device) -> Penalties | None:
    rows = [row for row, r in enumerate(requests) if _uses_penalties(r.sampling_params)]
    if not rows:
        return None
    params = [requests[row].sampling_params for row in rows]
    outputs = [requests[row].output_token_ids for row in rows]
    prompts = [
        requests[row].prompt_token_ids if p.repetition_penalty != 1.0 else [] for row, p in zip(rows, params)
    ]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    return Penalties(
        rows=_long(rows, device),
        repetition=column([p.repetition_penalty for p in params]),
        presence=column([p.presence_penalty for p in params]),
        frequency=column([p.frequency_penalty for p in params]),
        output_tokens=_flat_pairs(outputs, device),
        prompt_tokens=_flat_pairs(prompts, device) if any(prompts) else None,
    )


def _flat_pairs(token_lists: list[list[int]], device: torch.device) -> torch.Tensor:
    """[2, total] int64: (index of the list, token) for every token of every list."""
    lengths = torch.tensor([len(t) for t in token_lists])
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    return torch.stack([rows, tokens]).to(device)


def _pairs(pairs: list[tuple[int, int]], device: torch.device) -> torch.Tensor | None:
    if not pairs:
        return None
    return torch.tensor(pairs, dtype=torch.int64).T.contiguous().to(device)


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
