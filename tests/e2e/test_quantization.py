"""`--quantization fp16` on the real model: how far its logprobs drift from fp32, on the checks' prompts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llmserve import LLM, SamplingParams
from tests.e2e.conftest import PROMPTS
from tests.engine.greedy_compare import assert_same_greedy


@pytest.fixture(scope="module")
def fp16_llm() -> Iterator[LLM]:
    engine = LLM(quantization="fp16", kv_cache_memory=256 << 20, multiprocess=False)
    yield engine
    engine.shutdown()


def test_fp16_weights_drift_little_from_fp32(llm: LLM, fp16_llm: LLM) -> None:
    """Measured: mean |Δ logprob| of the prompt tokens ~0.002 nats, largest ~0.01."""
    params = SamplingParams(temperature=0.0, max_tokens=16, prompt_logprobs=0, logprobs=2)
    drifts: list[float] = []
    for full, half in zip(
        llm.generate(PROMPTS, params, use_tqdm=False), fp16_llm.generate(PROMPTS, params, use_tqdm=False)
    ):
        assert full.prompt_logprobs is not None and half.prompt_logprobs is not None
        for token, a, b in zip(full.prompt_token_ids[1:], full.prompt_logprobs[1:], half.prompt_logprobs[1:]):
            assert a is not None and b is not None
            drifts.append(abs(a[token].logprob - b[token].logprob))
        assert_same_greedy(full.outputs[0], half.outputs[0])
    assert max(drifts) < 0.05
    assert sum(drifts) / len(drifts) < 0.01
