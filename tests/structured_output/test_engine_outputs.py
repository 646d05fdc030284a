"""Structured outputs end to end on the real default model (SmolLM2-135M-Instruct), offline: every output
matches its constraint, free requests in the batch are untouched, and a grammar that fails in the core
ends only its own request."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import jsonschema
import pytest

from llmserve import LLM, AsyncLLM, RequestOutput, SamplingParams
from llmserve.engine.core import EngineCore
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.scheduling.request import Request
from llmserve.structured_output import grammars
from llmserve.structured_output.grammars import StructuredOutputError
from tests.greedy_match import assert_same_greedy

SCHEMAS: list[dict[str, object]] = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "sunny": {"type": "boolean"},
        },
        "required": ["city", "tags", "sunny"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "maximum": 1000}, "minItems": 2, "maxItems": 5},
]
PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"
# Lark: a sentence from a small vocabulary, and the same language as a Python regex to check it
SENTENCE = (
    'start: subject " " verb " " object "."\n'
    'subject: "The cat" | "A dog"\nverb: "sees" | "eats"\nobject: "fish" | "the moon"'
)
SENTENCE_RE = r"(The cat|A dog) (sees|eats) (fish|the moon)\."


def greedy(structured: StructuredOutputsParams | None = None, max_tokens: int = 96) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, structured_outputs=structured)


def sampled(structured: StructuredOutputsParams, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=96, structured_outputs=structured)


def core_of(llm: LLM) -> EngineCore:
    return llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined,no-any-return]


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> Iterator[LLM]:
    engine = LLM(kv_cache_memory=64 << 20, max_model_len=1024)  # the engine core in its own process
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "weather", "numbers"])
def test_json_schema_outputs_parse_and_validate_greedy_and_sampled(
    llm: LLM, schema: dict[str, object]
) -> None:
    structured = StructuredOutputsParams(json=schema)
    params = [greedy(structured)] + [sampled(structured, seed) for seed in range(5)]
    for out in llm.generate([PROMPT] * len(params), params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text  # EOS once the JSON is complete
        jsonschema.validate(json.loads(completion.text), schema)
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", completion.text))  # compact


def test_regex_choice_and_lark_outputs_match(llm: LLM) -> None:
    cases = [
        (StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8}-\d{3}"), r"[A-Z][a-z]{2,8}-\d{3}"),
        (StructuredOutputsParams(choice=["positive", "negative", "neutral"]), r"positive|negative|neutral"),
        (StructuredOutputsParams(grammar=SENTENCE), SENTENCE_RE),
    ]
    for structured, pattern in cases:
        params = [greedy(structured)] + [sampled(structured, seed) for seed in range(4)]
        for out in llm.generate(["Say something:"] * len(params), params, use_tqdm=False):
            assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop"


def test_free_requests_in_a_mixed_batch_get_the_tokens_they_get_alone(llm: LLM) -> None:
    free_prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    free = greedy(max_tokens=24)
    alone = [llm.generate(p, free, use_tqdm=False)[0] for p in free_prompts]
    structured = [greedy(StructuredOutputsParams(json=schema)) for schema in SCHEMAS]
    mixed = llm.generate(
        [PROMPT] * len(structured) + free_prompts, structured + [free] * len(free_prompts), use_tqdm=False
    )
    for out, schema in zip(mixed, SCHEMAS):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    for together, single in zip(mixed[len(structured) :], alone):
        assert_same_greedy(llm, together, single)


def test_an_invalid_schema_raises_before_anything_is_submitted(llm: LLM) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": 3}))
    with pytest.raises(ValueError, match="structured_outputs.json"):
        llm.generate(["a", "b"], [SamplingParams(), bad], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_grammar_failing_in_the_core_raises_and_the_engine_goes_on(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grammars, "check", lambda params, tokenizer, limits: None)  # let it reach the core
    broken = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-"))
    with pytest.raises(StructuredOutputError, match="unclosed character class"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=64, ignore_eos=True), broken], use_tqdm=False)
    monkeypatch.undo()
    (out,) = llm.generate("Hi", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


async def test_async_llm_fails_only_the_request_whose_grammar_failed(
    default_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grammars, "check", lambda params, tokenizer, limits: None)
    engine = AsyncLLM(kv_cache_memory=64 << 20, max_model_len=1024, log_stats=False)
    schema = SCHEMAS[0]

    async def run(request_id: str, params: SamplingParams) -> str:
        text = ""
        async for out in engine.generate(PROMPT, params, request_id):
            text = out.outputs[0].text
        return text

    try:
        results = await asyncio.gather(
            run("json", greedy(StructuredOutputsParams(json=schema))),
            run("broken", greedy(StructuredOutputsParams(grammar="start: nowhere"))),
            run("free", SamplingParams(max_tokens=16, ignore_eos=True)),
            return_exceptions=True,
        )
    finally:
        engine.shutdown()
    jsonschema.validate(json.loads(results[0]), schema)  # type: ignore[arg-type]
    assert isinstance(results[1], StructuredOutputError) and "nowhere" in str(results[1])
    assert isinstance(results[2], str) and results[2]


def test_preemption_during_constrained_decoding_keeps_the_matchers_consistent(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SmolLM2's KV takes 720 KiB per block of 16 tokens: 12 blocks for 8 requests of ~100 tokens
    small = LLM(kv_cache_memory=12 * 737280, max_model_len=192, multiprocess=False)
    prompts = [PROMPT] * 8
    params = [greedy(StructuredOutputsParams(json=SCHEMAS[i % 2]), max_tokens=64) for i in range(8)]
    scheduler = core_of(small).scheduler
    preempt = scheduler._preempt
    accepted_when_preempted: list[int] = []

    def spy(request: Request) -> None:
        accepted_when_preempted.append(request.num_output_tokens)
        preempt(request)

    monkeypatch.setattr(scheduler, "_preempt", spy)
    try:
        tight = small.generate(prompts, params, use_tqdm=False)
    finally:
        small.shutdown()
    assert max(accepted_when_preempted, default=0) > 0  # preempted mid-output, its matcher advanced
    roomy = llm.generate(prompts, params, use_tqdm=False)
    for a, b, i in zip(tight, roomy, range(8)):
        jsonschema.validate(json.loads(a.outputs[0].text), SCHEMAS[i % 2])
        assert_same_greedy(llm, a, b)


def test_grammars_failing_together_leave_nothing_behind_and_lose_no_output(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stepping `LLMEngine` by hand: each failed request raises once, and is gone; the free request's
    outputs of a step that raised come with the next step."""
    monkeypatch.setattr(grammars, "check", lambda params, tokenizer, limits: None)
    engine = llm.llm_engine
    broken = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-"))
    engine.add_request("broken-1", "a", broken)
    engine.add_request("broken-2", "b", broken)
    engine.add_request("free", "c", SamplingParams(max_tokens=4, ignore_eos=True))
    errors = 0
    outputs: list[RequestOutput] = []
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        try:
            # a sampling request's outputs: RequestOutputs, never the pooling runner's
            outputs += cast(list[RequestOutput], engine.step())
        except StructuredOutputError:
            errors += 1
    assert not engine.has_unfinished_requests()
    assert 1 <= errors <= 2 and {o.request_id for o in outputs} == {"free"}
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
