"""The reference for logits processing: Hugging Face's processors, OpenAI's penalty formula, vLLM's order."""

from __future__ import annotations

from collections import Counter

import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from llmserve.sampling_params import SamplingParams


def reference_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    eos_token_id: int | None,
    bad_words_token_ids: list[list[int]] | None = None,
) -> torch.Tensor:
    """One row [vocab] processed as vLLM does: masks → min_tokens, logit_bias → penalties."""
    scores = logits.clone().unsqueeze(0)
    everything = torch.tensor([prompt + output], dtype=torch.int64)
    generated = torch.tensor([output], dtype=torch.int64).reshape(1, -1)
    if params.allowed_token_ids is not None:
        allowed = list(params.allowed_token_ids)
        scores = PrefixConstrainedLogitsProcessor(lambda *_: allowed, num_beams=1)(everything, scores)
    if bad_words_token_ids:  # vLLM matches a bad word's prefix against the output only
        scores = NoBadWordsLogitsProcessor(bad_words_token_ids)(generated, scores)
    stops = list(params.stop_token_ids or [])
    if eos_token_id is not None and not params.ignore_eos:
        stops.append(eos_token_id)
    if params.min_tokens and stops:
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, stops)(everything, scores)
    if params.logit_bias:
        bias = [[[token], value] for token, value in params.logit_bias.items()]
        scores = SequenceBiasLogitsProcessor(bias)(everything, scores)  # type: ignore[arg-type]
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(everything, scores)
    # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, over the output
    for token, count in Counter(output).items():
        scores[0, token] -= count * params.frequency_penalty + params.presence_penalty
    return scores[0]
