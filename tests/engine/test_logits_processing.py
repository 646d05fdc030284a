"""Penalties, logit bias, min_tokens, bad words and allowed tokens: against Hugging Face's logits
processors (and OpenAI's penalty formula) on mixed batches, then end to end through `LLM`."""

from __future__ import annotations

import random
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.contracts import NewRequestData
from llmserve.model_executor import logits_processors
from llmserve.model_executor.logits_processors import (
    CompiledCache,
    apply_logits_processors,
    build_logits_metadata,
)
from llmserve.model_executor.request_state import CachedRequestState
from tests.engine.logits_reference import reference_logits
from tests.engine.test_llm_batching import assert_no_leaks, make_llm, random_prompts, runner_of
from tests.fixtures.tiny_llama import EOS_ID, VOCAB_SIZE

VOCAB = 48
EOS = 0
PLAIN = SamplingParams(temperature=0.0)


def request(
    params: SamplingParams, prompt: list[int], output: list[int], bad_words: list[list[int]] | None = None
) -> CachedRequestState:
    """The runner's state of a request with this history, as the scheduler's data builds it."""
    return CachedRequestState.from_new(NewRequestData("r", prompt, params, EOS, bad_words, None, output))


def history(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 20) for _ in range(n)]  # few distinct ids, so tokens repeat


# Two rows per feature, with different settings; each batch mixes them with rows that use nothing.
# (params, output suffix, bad words); the suffix puts a bad word's prefix at the end of the output.
FEATURES: dict[str, list[tuple[SamplingParams, list[int], list[list[int]] | None]]] = {
    "repetition_penalty": [
        (SamplingParams(repetition_penalty=1.7), [], None),
        (SamplingParams(repetition_penalty=0.6), [], None),
    ],
    "presence_penalty": [
        (SamplingParams(presence_penalty=1.5), [], None),
        (SamplingParams(presence_penalty=-0.5), [], None),
    ],
    "frequency_penalty": [
        (SamplingParams(frequency_penalty=0.8), [], None),
        (SamplingParams(frequency_penalty=-2.0), [], None),
    ],
    "logit_bias": [
        (SamplingParams(logit_bias={5: 3.0, 9: -40.0, 30: 250.0}), [], None),
        (SamplingParams(logit_bias={7: 100.0}), [], None),
    ],
    "min_tokens": [
        (SamplingParams(max_tokens=64, min_tokens=40, stop_token_ids=[11, 12]), [], None),
        (SamplingParams(max_tokens=64, min_tokens=40, ignore_eos=True, stop_token_ids=[20]), [], None),
    ],
    "allowed_token_ids": [
        (SamplingParams(allowed_token_ids=[1, 2, 3, 47]), [], None),
        (SamplingParams(allowed_token_ids=[40]), [], None),
    ],
    "bad_words": [
        (SamplingParams(bad_words=["x"]), [6, 7], [[3], [4, 5], [6, 7, 8]]),
        (SamplingParams(bad_words=["x"]), [4], [[4, 5], [9, 4, 10]]),
    ],
    "everything": [
        (
            SamplingParams(
                repetition_penalty=1.3,
                presence_penalty=0.4,
                frequency_penalty=0.3,
                logit_bias={2: 1.0, 3: -1.0, 40: 5.0},
                max_tokens=64,
                min_tokens=50,
                stop_token_ids=[13],
                allowed_token_ids=list(range(0, 48, 2)),
                bad_words=["x"],
            ),
            [4],
            [[4, 6], [8]],
        ),
        (SamplingParams(repetition_penalty=0.9, frequency_penalty=1.0, logit_bias={1: 2.0}), [], None),
    ],
}


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_matches_the_reference_in_a_mixed_batch(feature: str) -> None:
    rng = random.Random(feature)
    rows: list[tuple[CachedRequestState, list[list[int]] | None]] = []
    first, second = FEATURES[feature]
    for params, suffix, bad_words in [(PLAIN, [], None), first, (PLAIN, [], None), second]:
        output = history(rng, rng.randrange(0, 12)) + suffix
        rows.append((request(params, history(rng, rng.randrange(1, 12)), output, bad_words), bad_words))
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    raw = logits.clone()
    meta = build_logits_metadata([r for r, _ in rows], VOCAB, torch.device("cpu"))
    assert meta is not None
    processed = apply_logits_processors(logits, meta)
    assert torch.equal(logits, raw), "the raw logits (for logprobs) must stay untouched"
    for i, (r, bad_words) in enumerate(rows):
        expected = reference_logits(
            raw[i], r.sampling_params, r.prompt_token_ids, r.output_token_ids, EOS, bad_words
        )
        torch.testing.assert_close(processed[i], expected, rtol=0, atol=1e-5)
        if r.sampling_params is PLAIN:
            assert torch.equal(processed[i], raw[i])
        else:
            assert not torch.equal(processed[i], raw[i]), f"{feature} changed nothing in row {i}"


def test_logit_bias_is_clamped_to_100() -> None:
    clamped = SamplingParams(logit_bias={1: 250.0, 2: -1e9, 3: float("-inf"), 4: 7}).logit_bias
    assert clamped == {1: 100.0, 2: -100.0, 3: -100.0, 4: 7.0}


def test_no_metadata_when_no_row_needs_processing() -> None:
    done = request(SamplingParams(min_tokens=2), [1, 2], [3, 4])  # min_tokens already reached
    assert build_logits_metadata([request(PLAIN, [1], []), done], VOCAB, torch.device("cpu")) is None


FULL_VOCAB = 49152  # a full vocabulary's worth of logit_bias keys, as in the probe that found it slow


def full_vocabulary_params(seed: int) -> SamplingParams:
    """A logit_bias on every token (some past the clamp) and all tokens but every 7th allowed, shuffled."""
    rng = random.Random(seed)
    tokens = list(range(FULL_VOCAB))
    rng.shuffle(tokens)
    return SamplingParams(
        logit_bias={t: rng.uniform(-150.0, 150.0) for t in tokens},
        allowed_token_ids=[t for t in tokens if t % 7],
    )


def test_full_vocabulary_bias_and_allowed_ids_match_a_plain_computation() -> None:
    full = full_vocabulary_params(0)
    bias_only, allowed_only = full.clone(allowed_token_ids=None), full.clone(logit_bias=None)
    rows = [request(p, [1, 2], [3]) for p in (PLAIN, full, bias_only, PLAIN, allowed_only)]
    raw = torch.randn(len(rows), FULL_VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    meta = build_logits_metadata(rows, FULL_VOCAB, torch.device("cpu"))
    assert meta is not None
    processed = apply_logits_processors(raw, meta)
    vocab = torch.arange(FULL_VOCAB)
    for i, r in enumerate(rows):
        expected = raw[i].clone()
        allowed, bias = r.sampling_params.allowed_token_ids, r.sampling_params.logit_bias
        if allowed is not None:
            expected[~torch.isin(vocab, torch.tensor(allowed))] = float("-inf")
        if bias is not None:
            expected += torch.tensor([bias[t] for t in range(FULL_VOCAB)], dtype=torch.float32)
        assert torch.equal(processed[i], expected), i


class UnreadableBias(dict[int, float]):
    """A logit_bias that fails any pass over its items: a step that still walks the map raises."""

    def __iter__(self) -> Iterator[int]:
        raise AssertionError("the step iterated over logit_bias")

    def items(self) -> Any:
        raise AssertionError("the step iterated over logit_bias")

    def keys(self) -> Any:
        raise AssertionError("the step iterated over logit_bias")

    def values(self) -> Any:
        raise AssertionError("the step iterated over logit_bias")


def test_steps_after_the_first_reuse_the_compiled_tensors_of_64_full_vocabulary_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """n=64 with a full-vocabulary logit_bias: the first step compiles each request's map once; the next
    reuses those tensors (same objects) and neither compiles nor reads any map again."""
    params = full_vocabulary_params(2)
    rows = [request(params, [1, 2], [3]) for _ in range(64)]
    cache: CompiledCache = weakref.WeakKeyDictionary()
    device = torch.device("cpu")
    first = build_logits_metadata(rows, FULL_VOCAB, device, cache)
    compiled = [cache[r] for r in rows]
    assert all(c.bias is not None and len(c.bias[0]) == FULL_VOCAB for c in compiled)

    def no_compile(request: CachedRequestState, device: torch.device) -> None:
        raise AssertionError("a request was compiled twice")

    monkeypatch.setattr(logits_processors, "_compile", no_compile)
    monkeypatch.setattr(params, "logit_bias", UnreadableBias(params.logit_bias or {}))
    monkeypatch.setattr(params, "allowed_token_ids", None)  # the compiled tensors must still restrict
    second = build_logits_metadata(rows, FULL_VOCAB, device, cache)
    assert all(cache[r] is c for r, c in zip(rows, compiled))
    assert first is not None and second is not None
    for field in ("allowed_rows", "allowed_mask", "bias_index", "bias_values"):
        assert torch.equal(getattr(first, field), getattr(second, field)), field
    assert first.bias_index is not None and first.bias_index.shape == (2, 64 * FULL_VOCAB)


def test_compiled_processing_goes_with_its_request() -> None:
    cache: CompiledCache = weakref.WeakKeyDictionary()
    params = SamplingParams(logit_bias={1: 1.0}, allowed_token_ids=[1, 2])
    kept, dropped = request(params, [1], []), request(params, [1], [])
    assert build_logits_metadata([kept, dropped], VOCAB, torch.device("cpu"), cache) is not None
    assert len(cache) == 2
    del dropped
    assert list(cache) == [kept]


# ---- end to end, on the tiny model ----


@pytest.fixture(scope="module")
def llm(tiny_llama_hf_dir: Path) -> Iterator[LLM]:
    engine = make_llm(tiny_llama_hf_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_hf_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_hf_dir, dtype=torch.float32).eval()


def tokens_of(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)  # type: ignore[no-any-return]


def test_greedy_batch_picks_the_argmax_of_the_reference_logits(llm: LLM, hf_tiny: Any) -> None:
    """Each generated token is the argmax of the HF model's logits processed by the reference, given
    the tokens before it (teacher forced), for a batch mixing every feature with plain requests."""
    a, b = tokens_of(llm, "a")[0], tokens_of(llm, "b")[0]
    settings: list[dict[str, Any]] = [
        {},
        {"repetition_penalty": 2.0},
        {"presence_penalty": 2.0, "frequency_penalty": 1.0},
        {"logit_bias": {a: 0.5, b: -0.5}},
        {"min_tokens": 12, "stop_token_ids": [a]},
        {"allowed_token_ids": list(range(40, 120))},
        {"bad_words": ["a", "b c"]},
        {"repetition_penalty": 0.5, "frequency_penalty": -1.0, "logit_bias": {EOS_ID: 3.0}, "min_tokens": 4},
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=16, **s) for s in settings]
    prompts = random_prompts(len(params), 20, 60, seed=11)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    changed = 0
    for prompt, sp, out in zip(prompts, params, outputs):
        request = llm.llm_engine.input_processor.process_inputs("check", prompt, sp)[0]
        sp = request.sampling_params  # as the core sees them (with any extra EOS ids as stop tokens)
        prompt_ids, ours = prompt["prompt_token_ids"], out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf_tiny(torch.tensor([prompt_ids + ours])).logits[0, len(prompt_ids) - 1 :].float()
        for i, token in enumerate(ours):
            processed = reference_logits(
                logits[i], sp, prompt_ids, ours[:i], EOS_ID, request.bad_words_token_ids
            )
            assert processed[token] >= processed.max() - 1e-4, (settings, i)
            changed += int(logits[i].argmax() != token)
    assert changed > 0, "no setting changed any greedy choice: the test shows nothing"
    assert_no_leaks(llm)


def test_logit_bias_of_100_forces_a_token_and_allowed_token_ids_restrict(llm: LLM) -> None:
    prompts = random_prompts(4, 5, 30, seed=12)
    forced = SamplingParams(temperature=1.0, max_tokens=12, logit_bias={77: 100.0}, seed=1)
    assert all(o.outputs[0].token_ids == [77] * 12 for o in llm.generate(prompts, forced, use_tqdm=False))
    allowed = SamplingParams(temperature=1.5, max_tokens=24, allowed_token_ids=[5, 50, 150], seed=2)
    seen = {t for o in llm.generate(prompts, allowed, use_tqdm=False) for t in o.outputs[0].token_ids}
    assert seen == {5, 50, 150}


def test_compiled_processing_is_freed_when_requests_finish_or_are_aborted(llm: LLM) -> None:
    cache = runner_of(llm).logits_cache
    params = SamplingParams(
        n=3, max_tokens=40, ignore_eos=True, logit_bias={5: 1.0, 50: -1.0}, allowed_token_ids=[5, 50, 150]
    )
    engine = llm.llm_engine
    engine.add_request("probe", random_prompts(1, 5, 10, seed=15)[0], params)
    engine.step()
    assert len(cache) == 3, "each sample's request is compiled on its first step"
    engine.abort_request(["probe"])
    assert len(cache) == 0
    llm.generate(random_prompts(4, 5, 10, seed=16), params.clone(max_tokens=4), use_tqdm=False)
    assert len(cache) == 0
    assert_no_leaks(llm)


def test_min_tokens_holds_back_eos_and_stop_tokens_until_reached(llm: LLM) -> None:
    prompt = random_prompts(1, 10, 10, seed=13)[0]
    eos = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=5, logit_bias={EOS_ID: 100.0})
    out = llm.generate(prompt, eos, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == EOS_ID and out.finish_reason == "stop"
    assert EOS_ID not in out.token_ids[:5]
    stop = SamplingParams(
        temperature=1.0, max_tokens=30, min_tokens=3, stop_token_ids=[99], logit_bias={99: 100.0}
    )
    out = llm.generate(prompt, stop, use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.token_ids[-1], out.stop_reason) == (4, 99, 99)


def test_bad_words_never_appear(llm: LLM) -> None:
    """Sampling among a, b and c produces every pattern; with bad words "a" and "bc" none of those."""
    a, b, c = (tokens_of(llm, ch)[0] for ch in "abc")
    prompts = random_prompts(4, 5, 30, seed=14)
    free = SamplingParams(temperature=1.0, max_tokens=32, allowed_token_ids=[a, b, c], seed=3)
    banned = free.clone(bad_words=["a", "bc"])

    def texts(params: SamplingParams) -> list[str]:
        return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]

    unconstrained = texts(free)
    assert any("a" in t for t in unconstrained) and any("bc" in t for t in unconstrained)
    for text in texts(banned):
        assert len(text) == 32 and "a" not in text and "bc" not in text


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ],
)
def test_invalid_params_raise_naming_the_field(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(logprobs=21), "logprobs=21"),
        (SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
        (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),  # the vocabulary is over 20
        (SamplingParams(logit_bias={VOCAB_SIZE: 1.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[1, VOCAB_SIZE]), "allowed_token_ids"),
        (SamplingParams(stop_token_ids=[VOCAB_SIZE + 3]), "stop_token_ids"),
    ],
)
def test_out_of_range_requests_are_refused_and_the_engine_keeps_serving(
    llm: LLM, params: SamplingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate("hi", params, use_tqdm=False)
    assert_no_leaks(llm)
    assert llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].finished
