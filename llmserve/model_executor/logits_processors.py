"""Logits processing before sampling, in vLLM's order: masks → min_tokens and logit_bias → penalties.

Temperature, min-p and top-k/top-p follow in the sampler. Each feature's tensors exist only when some
row of the batch uses it, so a batch that uses none pays nothing: `build_logits_metadata` returns None.
What a request fixes for its whole life (its logit_bias, allowed_token_ids, min_tokens stops and one-token
bad words) is compiled into tensors on its first step, so a step's cost does not grow with their size.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from llmserve.model_executor.request_state import CachedRequestState
from llmserve.sampling_params import SamplingParams


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


@dataclass(frozen=True)
class CompiledProcessing:
    """One request's step-invariant processing, as tensors on the runner's device."""

    bias: tuple[torch.Tensor, torch.Tensor] | None  # [c] int64 tokens, [c] fp32 values (clamped)
    allowed: torch.Tensor | None  # [a] int64: allowed_token_ids
    min_tokens_banned: torch.Tensor | None  # [s] int64: stop tokens and EOS, banned while min_tokens is unmet
    banned: torch.Tensor | None  # [w] int64: one-token bad words, always banned
    prefixed_bad_words: list[list[int]]  # bad words of several tokens: banned after their prefix


# Per-request compiled processing, owned by the model runner. Weak keys: an entry goes with its request
# when the scheduler drops a finished or aborted one, so nothing outlives it.
CompiledCache = weakref.WeakKeyDictionary[CachedRequestState, CompiledProcessing]


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


def _needs_processing(request: CachedRequestState) -> bool:
    params = request.sampling_params
    return params.allowed_token_ids is not None or bool(params.logit_bias) or reads_history(request)


class History(Protocol):
    """What `reads_history` reads of a request: the runner's state, or the scheduler's `Request` when
    the speculator decides whether to guess."""

    sampling_params: SamplingParams
    bad_words_token_ids: list[list[int]] | None

    @property
    def num_output_tokens(self) -> int: ...


def reads_history(request: History) -> bool:
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
    requests: list[CachedRequestState],
    vocab_size: int,
    device: torch.device,
    cache: CompiledCache | None = None,
) -> LogitsMetadata | None:
    """The step's processing for `requests` (one per sampling row), or None when none uses any.

    `cache` keeps each request's compiled tensors between steps (for one device); without it they are
    compiled for this call only."""
    if not any(_needs_processing(r) for r in requests):
        return None
    if cache is None:
        cache = weakref.WeakKeyDictionary()
    compiled = [_compiled(r, device, cache) for r in requests]
    allowed = [(row, c.allowed) for row, c in enumerate(compiled) if c.allowed is not None]
    allowed_mask = None
    if allowed:
        allowed_mask = torch.zeros(len(allowed), vocab_size, dtype=torch.bool, device=device)
        index = _row_pairs([(i, tokens) for i, (_, tokens) in enumerate(allowed)], device)
        allowed_mask[index[0], index[1]] = True
    bias = [(row, c.bias) for row, c in enumerate(compiled) if c.bias is not None]
    return LogitsMetadata(
        allowed_rows=_long([row for row, _ in allowed], device) if allowed else None,
        allowed_mask=allowed_mask,
        banned=_banned(requests, compiled, device),
        bias_index=_row_pairs([(row, tokens) for row, (tokens, _) in bias], device) if bias else None,
        bias_values=torch.cat([values for _, (_, values) in bias]) if bias else None,
        penalties=_penalties(requests, device),
    )


def _compiled(request: CachedRequestState, device: torch.device, cache: CompiledCache) -> CompiledProcessing:
    """The request's compiled processing, built on its first step: the only pass over its maps."""
    compiled = cache.get(request)
    if compiled is None:
        compiled = cache[request] = _compile(request, device)
    return compiled


def _compile(request: CachedRequestState, device: torch.device) -> CompiledProcessing:
    """Everything of the request's processing that its generated tokens cannot change."""
    params = request.sampling_params
    stops = list(params.stop_token_ids or ())
    if request.eos_token_id is not None and not params.ignore_eos:
        stops.append(request.eos_token_id)
    words = request.bad_words_token_ids or []
    one_token = [word[0] for word in words if len(word) == 1]
    bias = params.logit_bias
    return CompiledProcessing(
        bias=(
            (_long(list(bias), device), torch.tensor(list(bias.values()), dtype=torch.float32, device=device))
            if bias
            else None
        ),
        allowed=None if params.allowed_token_ids is None else _long(params.allowed_token_ids, device),
        min_tokens_banned=_long(stops, device) if params.min_tokens and stops else None,
        banned=_long(one_token, device) if one_token else None,
        prefixed_bad_words=[word for word in words if len(word) > 1],
    )


def _banned(
    requests: list[CachedRequestState], compiled: list[CompiledProcessing], device: torch.device
) -> torch.Tensor | None:
    """[2, b] (row, token) to set to -inf: EOS and stop tokens until min_tokens is reached, one-token bad
    words, and the bad words whose prefix was just generated (vLLM compares against the output only)."""
    fixed: list[tuple[int, torch.Tensor]] = []
    prefixed: list[tuple[int, int]] = []
    for row, (request, c) in enumerate(zip(requests, compiled)):
        num_output = request.num_output_tokens
        if c.min_tokens_banned is not None and num_output < request.sampling_params.min_tokens:
            fixed.append((row, c.min_tokens_banned))
        if c.banned is not None:
            fixed.append((row, c.banned))
        for word in c.prefixed_bad_words:
            if len(word) - 1 <= num_output and request.all_token_ids[1 - len(word) :] == word[:-1]:
                prefixed.append((row, word[-1]))
    pairs = [_row_pairs(fixed, device)] if fixed else []
    if prefixed:
        pairs.append(_pairs(prefixed, device))
    return torch.cat(pairs, dim=1) if pairs else None


def _row_pairs(parts: list[tuple[int, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """[2, total] int64: (row, token) for every token of each row's tensor, in order. Written in place:
    one copy of the tokens and a fill per part, the least memory traffic for what can be the whole
    vocabulary per row."""
    pairs = torch.empty(2, sum(len(t) for _, t in parts), dtype=torch.int64, device=device)
    torch.cat([t for _, t in parts], out=pairs[1])
    start = 0
    for row, tokens in parts:
        pairs[0, start : start + len(tokens)] = row
        start += len(tokens)
    return pairs


def _penalties(requests: list[CachedRequestState], device: torch.device) -> Penalties | None:
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


def _pairs(pairs: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).T.contiguous().to(device)


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
