"""Continuous batching, preemption, chunked prefill, seeds and leaks, on a tiny random Llama."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.engine.core import EngineCore
from llmserve.engine.input_processor import TokensPrompt
from llmserve.model_executor.model_runner import ModelRunner
from llmserve.model_executor.native_decoder import NativeDecoder
from tests.fixtures.tiny_llama import VOCAB_SIZE
from tests.greedy_match import assert_same_greedy


def make_llm(model: Path, **kwargs: object) -> LLM:
    options: dict[str, object] = {"kv_cache_memory": 8 << 20, "multiprocess": False, **kwargs}
    return LLM(model=str(model), **options)


def core_of(llm: LLM) -> EngineCore:
    return llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined,no-any-return]


def runner_of(llm: LLM) -> ModelRunner:
    """`core_of(llm).model_runner`, typed as a generating engine's (not an embedding engine's) runner."""
    return cast(ModelRunner, core_of(llm).model_runner)


def count_native_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-item list counting the decode steps in-process engines run through decoder_step.c."""
    calls = [0]
    step = NativeDecoder.__call__

    def counted(self: NativeDecoder, *args: Any) -> torch.Tensor:
        calls[0] += 1
        return step(self, *args)

    monkeypatch.setattr(NativeDecoder, "__call__", counted)
    return calls


@pytest.fixture(scope="module")
def llm(tiny_llama_hf_dir: Path) -> Iterator[LLM]:
    engine = make_llm(tiny_llama_hf_dir)
    yield engine
    engine.shutdown()


def random_prompts(count: int, low: int, high: int, seed: int = 0) -> list[TokensPrompt]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(low, high))]}
        for _ in range(count)
    ]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def assert_no_leaks(llm: LLM) -> None:
    core = core_of(llm)
    assert not core.scheduler.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.limits.num_kv_blocks
    if isinstance(core.model_runner, ModelRunner):  # the runner's state of every request is gone too
        assert not core.model_runner.requests and not core.model_runner.logits_cache


def test_64_mixed_prompts_batched_match_one_at_a_time(llm: LLM) -> None:
    prompts = random_prompts(64, 5, 300)
    rng = random.Random(1)
    params = [greedy(rng.randint(1, 24)) for _ in prompts]
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in batched] == [p["prompt_token_ids"] for p in prompts]
    for prompt, sp, out in zip(prompts, params, batched):
        alone = llm.generate(prompt, sp, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == sp.max_tokens
        assert_same_greedy(llm, out, alone)
    assert_no_leaks(llm)


def test_preemption_with_a_small_pool_gives_the_same_outputs(tiny_llama_hf_dir: Path, llm: LLM) -> None:
    prompts = random_prompts(16, 150, 250, seed=2)
    params = greedy(48)
    # 16 × ~250 tokens need ~250 blocks of 16; give the small engine room for a quarter of them.
    small = make_llm(tiny_llama_hf_dir, kv_cache_memory=64 * 8192, max_model_len=512)
    try:
        tight = small.generate(prompts, params, use_tqdm=False)
        assert core_of(small).scheduler.num_preemptions > 0
        assert_no_leaks(small)
    finally:
        small.shutdown()
    roomy = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(tight, roomy, strict=True):
        assert_same_greedy(llm, a, b)


def test_chunked_prefill_matches_unchunked(tiny_llama_hf_dir: Path, llm: LLM) -> None:
    prompt = random_prompts(1, 700, 700, seed=3)[0]
    chunked = make_llm(tiny_llama_hf_dir, max_num_batched_tokens=64)
    try:
        a = chunked.generate(prompt, greedy(16), use_tqdm=False)[0]
    finally:
        chunked.shutdown()
    b = llm.generate(prompt, greedy(16), use_tqdm=False)[0]
    assert_same_greedy(llm, a, b)


def test_same_seed_same_sample_alone_and_in_a_batch(llm: LLM) -> None:
    prompt = random_prompts(1, 20, 20, seed=4)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0]
    others = random_prompts(7, 5, 60, seed=5)
    mixed_params = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)] * 7 + [seeded]
    batch = llm.generate([*others, prompt], mixed_params, use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone.token_ids
    assert batch[-1].outputs[0].text == alone.text
    different = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=4321, ignore_eos=True)
    assert llm.generate(prompt, different, use_tqdm=False)[0].outputs[0].token_ids != alone.token_ids


def test_n_samples_are_distinct_and_reproducible(llm: LLM) -> None:
    prompt = random_prompts(1, 10, 10, seed=6)[0]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=99, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 4
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": [5] * 1024}, SamplingParams(), "max_model_len"),
        ({"prompt_token_ids": [5, VOCAB_SIZE + 10]}, SamplingParams(), "out of vocabulary"),
        ({"prompt_token_ids": [5, -1]}, SamplingParams(), "out of vocabulary"),
        ("hi", {"temperature": -1.0}, "temperature"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"top_p": 1.5}, "top_p"),
        ("hi", {"top_k": -2}, "top_k"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", SamplingParams(logprobs=21), "logprobs"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(
    llm: LLM, prompt: object, params: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        sp = SamplingParams(**params) if isinstance(params, dict) else params
        llm.generate(prompt, sp, use_tqdm=False)  # type: ignore[arg-type]
    assert_no_leaks(llm)
    assert llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].finished


def test_missing_model_path_raises() -> None:
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(model="/tmp/does-not-exist/model.gguf")
