"""Speculative decoding (n-gram lookup) on the real default model changes no output: greedy tokens,
logprobs, stop strings, max_tokens, structured outputs, prefix caching and preemption behave as without
it. The guesses are real: each test checks that some were made and confirmed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from llmserve import LLM, SamplingParams
from llmserve.contracts import SpecDecodingStats
from llmserve.sampling_params import StructuredOutputsParams
from tests.e2e.conftest import PROMPTS

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
# Code to repeat: a copy of an early block_pool.py, frozen so that editing the engine changes no prompt
CODE = (Path(__file__).parent / "rewrite_source.txt").read_text()
PASSAGE = (
    "The harbour town kept its lighthouse lit every night for two hundred years. In 1911 a storm broke "
    "the lantern glass, and the keeper, Ada Marsh, kept a lamp burning in the window until the new glass "
    "arrived from the mainland. The town still lights a candle in every window on the anniversary."
)
# Outputs that repeat their input, as chat messages
GROUNDED = [
    [{"role": "user", "content": f"{CODE}\n\nRewrite this file, renaming BlockPool to KVBlockPool."}],
    [{"role": "user", "content": f"{PASSAGE}\n\nQuote the sentence about the storm word for word."}],
]


@pytest.fixture(scope="module")
def spec_llm() -> Iterator[LLM]:
    # in-process, so that the tests read the speculator's counts; guesses in batches of up to 16
    engine = LLM(
        kv_cache_memory=256 << 20,
        dtype="float32",
        multiprocess=False,
        speculative_config={**SPEC, "disable_by_batch_size": 16},
    )
    yield engine
    engine.shutdown()


def stats(engine: LLM) -> SpecDecodingStats:
    return engine.llm_engine.engine_core.engine_core.scheduler.make_stats().spec_decoding  # type: ignore[attr-defined,no-any-return]


def chat_prompts(engine: LLM) -> list[str]:
    tokenizer = engine.get_tokenizer()
    # tokenize=False: each is the prompt's text
    return [
        cast(str, tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True))
        for m in GROUNDED
    ]


def generate(engine: LLM, prompts: list[str], params: SamplingParams) -> list[Any]:
    return [o.outputs[0] for o in engine.generate(prompts, params, use_tqdm=False)]


def test_greedy_tokens_are_identical_alone_and_in_mixed_batches(llm: LLM, spec_llm: LLM) -> None:
    grounded = chat_prompts(spec_llm)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    before = stats(spec_llm)
    alone = generate(spec_llm, grounded[:1], params)
    after_alone = stats(spec_llm)
    batch = grounded + PROMPTS[:3]  # guessing and not, in one batch
    expected = generate(llm, batch, params)
    got = generate(spec_llm, batch, params)
    assert alone[0].token_ids == expected[0].token_ids
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    after = stats(spec_llm)
    # the lone rewrite confirmed most of its guesses; the batch guessed too
    accepted = after_alone.num_accepted_tokens - before.num_accepted_tokens
    assert accepted > 0.5 * (after_alone.num_draft_tokens - before.num_draft_tokens) > 0
    assert after.num_accepted_tokens > after_alone.num_accepted_tokens


def test_logprobs_stop_strings_and_max_tokens_are_unchanged(llm: LLM, spec_llm: LLM) -> None:
    grounded = chat_prompts(spec_llm)
    stop = "self.num_blocks"  # in the copied code, well inside a run of confirmed guesses
    cases = [
        SamplingParams(max_tokens=37, temperature=0.0, logprobs=3),
        SamplingParams(max_tokens=200, temperature=0.0, stop=[stop], include_stop_str_in_output=True),
    ]
    for params in cases:
        before = stats(spec_llm).num_accepted_tokens
        want, got = generate(llm, grounded[:1], params)[0], generate(spec_llm, grounded[:1], params)[0]
        assert stats(spec_llm).num_accepted_tokens > before
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
            want.stop_reason,
        )
        assert got.logprobs == want.logprobs and got.cumulative_logprob == want.cumulative_logprob
        assert len(got.token_ids) == 37 or got.stop_reason == stop


def test_structured_outputs_are_unchanged(llm: LLM, spec_llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"quote": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["quote", "year"],
    }
    prompt = chat_prompts(spec_llm)[1]
    params = SamplingParams(
        max_tokens=60, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)
    )
    before = stats(spec_llm).num_accepted_tokens
    want, got = generate(llm, [prompt], params)[0], generate(spec_llm, [prompt], params)[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    assert stats(spec_llm).num_accepted_tokens > before


def test_a_guess_past_a_complete_grammar_is_never_made(llm: LLM, spec_llm: LLM) -> None:
    # The earlier answer is followed by the end-of-turn token: at this length of answer, lookup guesses
    # `9 }` and then it, past the point where the grammar completes (which only EOS may follow).
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["city", "year"],
        "additionalProperties": False,
    }
    messages = [
        {"role": "user", "content": "Where and when was the treaty signed? Answer in JSON."},
        {"role": "assistant", "content": '{"city":"Paris","year":919}'},
        {"role": "user", "content": "Repeat exactly the same JSON answer."},
    ]
    # tokenize=False: the prompt's text
    prompt = cast(
        str,
        spec_llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
    )
    params = SamplingParams(
        max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)
    )
    want, got = generate(llm, [prompt], params)[0], generate(spec_llm, [prompt], params)[0]
    assert (got.text, got.finish_reason) == (want.text, "stop")


def test_prefix_cache_hits_and_seeded_sampling_is_unchanged(llm: LLM, spec_llm: LLM) -> None:
    prompt = chat_prompts(spec_llm)[0]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    first = generate(spec_llm, [prompt], greedy)[0]
    core = spec_llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
    hits = core.scheduler.make_stats().prefix_cache_hits
    assert generate(spec_llm, [prompt], greedy)[0].token_ids == first.token_ids
    assert core.scheduler.make_stats().prefix_cache_hits > hits
    # a seeded request samples each kept token from the same draws as without guesses: the same output
    seeded = SamplingParams(max_tokens=40, temperature=0.8, seed=11)
    before = stats(spec_llm).num_accepted_tokens
    want = generate(llm, [prompt], seeded)[0].token_ids
    assert generate(spec_llm, [prompt], seeded)[0].token_ids == want
    assert stats(spec_llm).num_accepted_tokens > before


def test_preemption_while_guessing_changes_no_output(llm: LLM) -> None:
    # a pool of ~520 tokens for three requests of ~330 that share no blocks: they preempt each other
    engine = LLM(
        kv_cache_memory=24 << 20,
        enable_prefix_caching=False,
        dtype="float32",
        multiprocess=False,
        speculative_config={**SPEC, "disable_by_batch_size": 16},
    )
    try:
        tokenizer = engine.get_tokenizer()
        # the code's first 219 tokens, a prompt of ~265: two fit the pool
        # at once, and their growth preempts one (a longer prompt would admit only one at a time)
        code = tokenizer.decode(tokenizer.encode(CODE, add_special_tokens=False)[:219])
        message = [{"role": "user", "content": f"{code}\n\nRewrite this file, renaming BlockPool to Pool."}]
        # tokenize=False: the prompt's text
        prompt = cast(str, tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True))
        prompts = [prompt] * 3
        params = SamplingParams(max_tokens=60, temperature=0.0)
        got = generate(engine, prompts, params)
        scheduler = engine.llm_engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
        assert scheduler.num_preemptions > 0 and stats(engine).num_accepted_tokens > 0
    finally:
        engine.shutdown()
    want = generate(llm, prompts[:1], params)[0]
    assert all(o.token_ids == want.token_ids for o in got)
