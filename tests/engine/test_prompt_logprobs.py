"""Prompt logprobs on the tiny model: equal to Hugging Face's, the same whether the prompt is prefilled
in one piece, in chunks or recomputed after preemption, and delivered once per the output kind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import AutoTokenizer

from llmserve import LLM, SamplingParams
from llmserve.contracts import EngineCoreOutput, EngineCoreRequest, FinishReason, TokenLogprobs
from llmserve.engine.output_processor import OutputProcessor
from llmserve.outputs import PromptLogprobs, RequestOutput
from llmserve.sampling_params import RequestOutputKind
from llmserve.scheduling.request import Request
from tests.engine.test_llm_batching import assert_no_leaks, core_of, make_llm, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama_hf_dir: Path) -> Iterator[LLM]:
    engine = make_llm(tiny_llama_hf_dir)
    yield engine
    engine.shutdown()


def assert_same(a: PromptLogprobs | None, b: PromptLogprobs | None, atol: float = 1e-4) -> None:
    assert a is not None and b is not None and len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:]):
        assert x is not None and y is not None and x.keys() == y.keys()
        for token in x:
            assert x[token].rank == y[token].rank
            assert abs(x[token].logprob - y[token].logprob) < atol


def test_prompt_logprobs_match_hf_and_chunking_changes_nothing(tiny_llama_hf_dir: Path, llm: LLM) -> None:
    prompt = random_prompts(1, 300, 300, seed=21)[0]
    ids = prompt["prompt_token_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    whole = llm.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
    chunked_llm = make_llm(tiny_llama_hf_dir, max_num_batched_tokens=64)
    try:
        chunked = chunked_llm.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
    finally:
        chunked_llm.shutdown()
    assert_same(chunked, whole)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [len, vocab]
    assert whole is not None
    for position, entry in enumerate(whole[1:], start=1):
        assert entry is not None
        expected = reference[position - 1]
        token = ids[position]
        assert abs(entry[token].logprob - expected[token].item()) < 1e-4
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None and lp.rank <= 3)
        assert [t for _, t in top] == expected.topk(3).indices.tolist()


def test_preemption_mid_prefill_and_after_does_not_repeat_prompt_logprobs(
    tiny_llama_hf_dir: Path, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = random_prompts(6, 80, 120, seed=22)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    # 24 blocks of 16 tokens for 6 requests of ~115 tokens, prefilled 48 tokens a step
    small = make_llm(
        tiny_llama_hf_dir, kv_cache_memory=24 * 8192, max_model_len=512, max_num_batched_tokens=48
    )
    scheduler = core_of(small).scheduler
    preempt = scheduler._preempt
    stages: set[str] = set()

    def spy(request: Request) -> None:
        stages.add("prefill" if request.num_computed_tokens < request.num_prompt_tokens else "decode")
        preempt(request)

    monkeypatch.setattr(scheduler, "_preempt", spy)
    try:
        tight = small.generate(prompts, params, use_tqdm=False)
        assert_no_leaks(small)
    finally:
        small.shutdown()
    assert stages == {"prefill", "decode"}
    for a, b in zip(tight, llm.generate(prompts, params, use_tqdm=False)):
        assert_same(a.prompt_logprobs, b.prompt_logprobs)


def entry(token: int) -> TokenLogprobs:
    return TokenLogprobs([token, 9], [-2.0, -0.5], [3, 1])


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_prompt_logprobs_delivered_once_for_delta_and_always_otherwise(
    tiny_llama_hf_dir: Path, kind: RequestOutputKind
) -> None:
    processor = OutputProcessor(AutoTokenizer.from_pretrained(tiny_llama_hf_dir))
    params = SamplingParams(max_tokens=2, prompt_logprobs=1, output_kind=kind)
    processor.add_request(EngineCoreRequest("r", [5, 6, 7], params, None, 0.0), None)
    steps = [
        EngineCoreOutput("r", [40], new_prompt_logprobs=[entry(6), entry(7)]),
        EngineCoreOutput("r", [41], finish_reason=FinishReason.LENGTH),
    ]
    outputs: list[RequestOutput] = []
    for step in steps:
        # a sampling request's outputs: RequestOutputs, never the pooling runner's
        outputs.extend(cast(list[RequestOutput], processor.process_outputs([step]).request_outputs))
    prompt_logprobs: list[Any] = [o.prompt_logprobs for o in outputs]
    expected = [None, {6: -2.0, 9: -0.5}, {7: -2.0, 9: -0.5}]
    got = [None if p is None else {t: lp.logprob for t, lp in p.items()} for p in prompt_logprobs[0]]
    assert got == expected and prompt_logprobs[0][1][6].rank == 3
    if kind == RequestOutputKind.DELTA:
        assert prompt_logprobs[1:] == [None]
    else:
        assert all(p == prompt_logprobs[0] for p in prompt_logprobs)
    assert len(outputs) == (1 if kind == RequestOutputKind.FINAL_ONLY else 2)
