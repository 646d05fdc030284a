"""Prefix caching changes speed, never outputs."""

from __future__ import annotations

import random
from pathlib import Path

from llmserve import SamplingParams
from llmserve.engine.input_processor import TokensPrompt
from tests.engine.test_llm_batching import assert_no_leaks, core_of, make_llm
from tests.fixtures.tiny_llama import VOCAB_SIZE
from tests.greedy_match import assert_same_greedy


def test_outputs_identical_with_prefix_caching_on_and_off(tiny_llama_hf_dir: Path) -> None:
    rng = random.Random(20)
    system = [rng.randrange(3, VOCAB_SIZE) for _ in range(100)]
    prompts: list[TokensPrompt] = [
        {"prompt_token_ids": system + [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, 40))]}
        for _ in range(24)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    results = {}
    for enabled in (True, False):
        llm = make_llm(tiny_llama_hf_dir, enable_prefix_caching=enabled, kv_cache_memory=48 * 8192)
        try:
            first = llm.generate(prompts[:1], params, use_tqdm=False)  # warms the cache
            rest = llm.generate(prompts[1:], params, use_tqdm=False)  # small pool: preemptions too
            results[enabled] = first + rest
            stats = core_of(llm).scheduler.make_stats()
            assert (stats.prefix_cache_hits > 0) == enabled
            assert_no_leaks(llm)
            if not enabled:
                for on, off in zip(results[True], results[False], strict=True):
                    assert_same_greedy(llm, on, off)
        finally:
            llm.shutdown()
