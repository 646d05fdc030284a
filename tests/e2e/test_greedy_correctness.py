"""Greedy output equals Hugging Face transformers' on the same GGUF weights, alone and batched."""

from __future__ import annotations

import random
from typing import Any

from llmserve import LLM, AsyncLLM, RequestOutput, RequestOutputKind, SamplingParams
from llmserve.engine.input_processor import TokensPrompt
from tests.e2e.conftest import PROMPTS
from tests.e2e.greedy_reference import (
    assert_matches_hf,
    assert_top_logprobs_match,
    hf_forced_references,
    hf_teacher_forced,
)

NUM_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)


def check_all(llm: LLM, hf_model: Any, outputs: list[RequestOutput]) -> None:
    """Each output against transformers' greedy choices forced along it; its prompt ids the tokenizer's."""
    tokenizer = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in outputs] == [tokenizer.encode(p) for p in PROMPTS]
    references = hf_forced_references(hf_model, outputs, NUM_TOKENS)
    ties = [assert_matches_hf(llm, o, ref) for o, ref in zip(outputs, references, strict=True)]
    print("near-ties:", {prompt[:30]: tie for prompt, tie in zip(PROMPTS, ties) if tie is not None})


def test_each_prompt_alone_matches_hf(llm: LLM, hf_model: Any) -> None:
    check_all(llm, hf_model, [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in PROMPTS])


def test_batch_of_mixed_lengths_matches_hf(llm: LLM, hf_model: Any) -> None:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    check_all(llm, hf_model, outputs)


def test_logprobs_match_hf(llm: LLM, hf_model: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    (reference,) = hf_forced_references(hf_model, [out], 8)
    output = out.outputs[0]
    assert output.logprobs is not None
    for position, entry in enumerate(output.logprobs):
        ref = reference.logprobs[position]
        top = ref.topk(5)
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None)
        assert [t for _, t, _ in ranked[:5]] == top.indices.tolist()
        for (_, _, ours), theirs in zip(ranked, top.values.tolist()):
            assert abs(ours - theirs) < 1e-3


def test_64_mixed_prompts_in_one_batch_match_hf_alone(llm: LLM, hf_model: Any) -> None:
    """Continuous batching: 64 prompts of 5-300 tokens with different max_tokens, all in one batch."""
    text = " ".join(PROMPTS) * 4
    ids = llm.get_tokenizer().encode(text)
    rng = random.Random(0)
    prompts: list[TokensPrompt] = []
    for _ in range(64):
        length = rng.randint(5, 300)
        start = rng.randrange(0, len(ids) - length)
        prompts.append({"prompt_token_ids": ids[start : start + length]})
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 16), ignore_eos=True, logprobs=2)
        for _ in prompts
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outputs):
        completion = out.outputs[0]
        assert len(completion.token_ids) == sp.max_tokens
        ref = hf_teacher_forced(hf_model, prompt["prompt_token_ids"], completion.token_ids)
        assert_matches_hf(llm, out, ref)


async def test_async_llm_logprobs_match_hf(llm: LLM, hf_model: Any) -> None:
    engine = AsyncLLM(kv_cache_memory=256 << 20, log_stats=False)
    try:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=8,
            ignore_eos=True,
            logprobs=5,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        outputs = [out async for out in engine.generate(PROMPTS[0], params, "async-logprobs")]
    finally:
        engine.shutdown()
    (reference,) = hf_forced_references(hf_model, outputs[-1:], 8)
    output = outputs[-1].outputs[0]
    assert output.logprobs is not None and len(output.logprobs) == 8
    assert_matches_hf(llm, outputs[-1], reference)
    assert_top_logprobs_match(output, reference, 5)
