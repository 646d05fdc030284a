"""`SamplingParams` refuses, with a `ValueError` naming the field, every value the engine could not
carry or compute with (integers past int64, non-finite floats, lone surrogates), as vLLM's
`__post_init__` does; the offline `LLM` then raises before anything reaches the engine core."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.parallel_sampling import ParentRequest
from llmserve.entrypoints.openai.protocol import check_context_length
from llmserve.sampling_params import INT64_MAX, INT64_MIN
from tests.engine.test_llm_batching import assert_no_leaks, make_llm
from tests.fixtures.tiny_llama import VOCAB_SIZE

HUGE = 2**70
NAN, INF = float("nan"), float("inf")

BAD_PARAMS: list[tuple[dict[str, Any], str]] = [
    ({"seed": HUGE}, "seed"),
    ({"seed": INT64_MAX + 1}, "seed"),
    ({"seed": INT64_MIN - 1}, "seed"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"top_k": HUGE}, "top_k"),
    ({"n": HUGE}, "n"),
    ({"n": True}, "n"),
    ({"logprobs": HUGE}, "logprobs"),
    ({"prompt_logprobs": HUGE}, "prompt_logprobs"),
    ({"min_tokens": HUGE, "max_tokens": None}, "min_tokens"),
    ({"logit_bias": {HUGE: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: NAN}}, "logit_bias"),
    ({"allowed_token_ids": [HUGE]}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"),
    ({"stop_token_ids": [HUGE]}, "stop_token_ids"),
    ({"stop_token_ids": [False]}, "stop_token_ids"),
    ({"stop": "a\ud800b"}, "stop"),
    ({"stop": ["ok", "\udfff"]}, "stop"),
    ({"bad_words": ["a\ud800b"]}, "bad_words"),
    *[
        ({name: value}, name)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
        for value in (NAN, INF, -INF)
    ],
]


@pytest.mark.parametrize(("kwargs", "field"), BAD_PARAMS)
def test_bad_values_raise_value_error_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_every_valid_params_encode_for_the_engine_core() -> None:
    """The bounds are what msgpack (and torch's generator seeds) take: the extremes encode."""
    params = SamplingParams(
        seed=INT64_MIN,
        max_tokens=INT64_MAX,
        top_k=INT64_MAX,
        min_tokens=INT64_MAX,
        logit_bias={INT64_MAX: 1.0},
        stop_token_ids=[INT64_MAX],
        allowed_token_ids=[INT64_MAX],
        temperature=1e300,
    )
    assert SamplingParams(logit_bias={5: -INF}).logit_bias == {5: -100.0}  # clamped, as vLLM does
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


def test_children_seeds_wrap_into_int64() -> None:
    """n > 1 seeds child i with seed + i: from the largest seed that must not leave int64, or the
    second child would fail to encode after the first was already submitted."""
    parent = ParentRequest("r", SamplingParams(n=3, seed=INT64_MAX))
    seeds = [p.seed for p in parent.child_params]
    assert seeds == [INT64_MAX, INT64_MIN, INT64_MIN + 1]
    for params in parent.child_params:
        msgspec.msgpack.encode(params)


def test_context_length_message_is_vllms() -> None:
    check_context_length(1000, 24, 1024)
    check_context_length(1000, None, 1024)
    with pytest.raises(ValueError) as error:
        check_context_length(1000, 25, 1024)
    assert str(error.value) == (
        "This model's maximum context length is 1024 tokens. However, you requested 1025 tokens "
        "(1000 in the messages, 25 in the completion). Please reduce the length of the messages or "
        "completion."
    )


@pytest.fixture(scope="module")
def llm(tiny_llama_hf_dir: Path) -> Iterator[LLM]:
    engine = make_llm(tiny_llama_hf_dir)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("a\ud800b", "Unicode"),
        ({"prompt": "\udc00"}, "Unicode"),
        ({"prompt_token_ids": [True, False]}, "prompt_token_ids"),
        ({"prompt_token_ids": [5, HUGE]}, "out of vocabulary"),
    ],
)
def test_offline_bad_prompts_raise_and_leave_nothing(llm: LLM, prompt: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert_no_leaks(llm)


def test_offline_vocabulary_and_logprobs_bounds(llm: LLM) -> None:
    for params, field in (
        (SamplingParams(allowed_token_ids=[VOCAB_SIZE]), "allowed_token_ids"),
        (SamplingParams(logit_bias={VOCAB_SIZE: 1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=[VOCAB_SIZE]), "stop_token_ids"),
    ):
        with pytest.raises(ValueError, match=field):
            llm.generate("hi", params, use_tqdm=False)
    assert_no_leaks(llm)


def test_offline_n2_with_the_largest_seed_runs(llm: LLM) -> None:
    params = SamplingParams(n=2, seed=INT64_MAX, temperature=1.0, max_tokens=3, ignore_eos=True)
    output = llm.generate("hi", params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in output.outputs] == [3, 3]
    assert_no_leaks(llm)
