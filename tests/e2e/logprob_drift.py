"""How far one engine's prompt logprobs move from another's on the same prompts: the measure of what a
`--quantization` costs."""

from __future__ import annotations

from llmserve import LLM, SamplingParams


def prompt_logprob_drifts(reference: LLM, other: LLM, prompts: list[str]) -> list[float]:
    """|Δ logprob| of every prompt token after the first, `other` against `reference`."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    pairs = zip(
        reference.generate(prompts, params, use_tqdm=False), other.generate(prompts, params, use_tqdm=False)
    )
    drifts: list[float] = []
    for full, rounded in pairs:
        assert full.prompt_logprobs is not None and rounded.prompt_logprobs is not None
        for token, a, b in zip(
            full.prompt_token_ids[1:], full.prompt_logprobs[1:], rounded.prompt_logprobs[1:]
        ):
            assert a is not None and b is not None
            drifts.append(abs(a[token].logprob - b[token].logprob))
    return drifts
