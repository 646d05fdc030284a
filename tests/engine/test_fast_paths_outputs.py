"""The fast paths change speed, never outputs: each is compared with the plain PyTorch path."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from llmserve import SamplingParams
from llmserve.model_executor.kernels import native
from tests.engine.greedy_compare import assert_same_greedy
from tests.engine.test_llm_batching import core_of, make_llm
from tests.fixtures.tiny_llama import VOCAB_SIZE


@pytest.mark.skipif(native.load_paged_attention() is None, reason="no C compiler here")
def test_native_decode_attention_gives_the_torch_outputs(tiny_llama_hf_dir: Path) -> None:
    rng = random.Random(5)
    shared = [rng.randrange(3, VOCAB_SIZE) for _ in range(40)]
    prompts = [
        {"prompt_token_ids": shared + [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, 90))]}
        for _ in range(12)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    results = {}
    for backend in ("auto", "torch"):
        # Small token budget: prefill chunks, prefix hits and decodes share steps.
        llm = make_llm(tiny_llama_hf_dir, attention_backend=backend, max_num_batched_tokens=64)
        try:
            assert core_of(llm).model_runner.native_decode == (backend == "auto")
            results[backend] = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
    for fast, plain in zip(results["auto"], results["torch"]):
        assert_same_greedy(fast.outputs[0], plain.outputs[0])
        for a, b in zip(fast.outputs[0].logprobs or [], plain.outputs[0].logprobs or []):
            for token, entry in a.items():
                assert abs(entry.logprob - b[token].logprob) < 1e-4
