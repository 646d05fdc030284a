"""Gemma 3 270M (the base model, Q4_K_M) as people download it: greedy completions equal `transformers`
fp32 on the same GGUF token for token, top-5 logprobs within 1e-3, one prompt longer than the 512-token
window of its local layers; through the OpenAI server too. Takes ~1 min, most of it transformers reading
the GGUF."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from llmserve import LLM, RequestOutput, SamplingParams
from llmserve.model_executor.loader import resolve_model
from llmserve.model_executor.loader.model_source import GEMMA_3_270M
from tests.e2e.greedy_reference import (
    Reference,
    assert_matches_hf,
    assert_top_logprobs_match,
    hf_forced_references,
)
from tests.entrypoints.remote_server import RemoteServer
from tests.hf_gguf import load_hf_gguf

NAME = "gemma-3-270m"
NUM_TOKENS = 32
KV_POOL = 128 << 20
WINDOW = 512
_CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Hanoi", "Perth", "Quito", "Dakar", "Riga", "Tunis", "Accra"]
_SKIES = ["clear", "cloudy", "rainy", "foggy", "windy", "stormy", "hazy"]


def long_prompt() -> str:
    """A weather log of ~900 tokens that ends mid-entry: its continuation reads back past the window."""
    lines = [
        f"Day {day}: in {_CITIES[day % len(_CITIES)]} the sky was {_SKIES[day * 3 % len(_SKIES)]} and the "
        f"temperature reached {11 + day * 7 % 19} degrees."
        for day in range(1, 41)
    ]
    return "Weather log\n\n" + "\n".join(lines) + "\nDay 41: in"


PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "The theory of general relativity, published by Albert Einstein in 1915, describes gravity as",
    "Here is a list of fruits:\n- apple\n- banana\n-",
    "Q: Why is the sky blue?\nA:",
    "1, 1, 2, 3, 5, 8, 13,",
    long_prompt(),
]
# Ids from transformers' AutoTokenizer on the same file (which takes ~25 s: the tokenizer we build
# skips its detour through the model config, see loader/tokenizer.py).
TOKENIZED = {
    "  Two spaces,\ta tab\n\nand émoji 😀": [2, 138, 11634, 9952, 236764, 255968, 236746, 6937, 108, 624]
    + [1559, 58197, 163543],
    "<start_of_turn>user\nx = [1, 22, 333]<end_of_turn>": [2, 105, 2364, 107, 236781, 578, 870, 236770]
    + [236764, 236743, 236778, 236778, 236764, 236743, 236800, 236800, 236800, 236842, 106],
}


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def gemma_llm(gemma_gguf_path: Path) -> Iterator[LLM]:
    llm = LLM(model=NAME, kv_cache_memory=KV_POOL, max_num_seqs=8, dtype="float32")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def gemma_outputs(gemma_llm: LLM) -> list[RequestOutput]:
    return gemma_llm.generate(PROMPTS, greedy(), use_tqdm=False)


@pytest.fixture(scope="module")
def references(gemma_gguf_path: Path, gemma_outputs: list[RequestOutput]) -> list[Reference]:
    model = load_hf_gguf(gemma_gguf_path, attn_implementation="eager")
    assert model.config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert model.config.sliding_window == WINDOW
    refs = hf_forced_references(model, gemma_outputs, NUM_TOKENS)
    del model
    return refs


def test_the_model_resolves_by_its_hugging_face_name(gemma_gguf_path: Path) -> None:
    assert resolve_model("google/gemma-3-270m").path == gemma_gguf_path
    assert gemma_gguf_path.stat().st_size == GEMMA_3_270M.size


def test_the_tokenizer_gives_transformers_ids(gemma_llm: LLM) -> None:
    tokenizer = gemma_llm.get_tokenizer()
    for text, ids in TOKENIZED.items():
        assert tokenizer(text).input_ids == ids
        assert tokenizer.decode(ids[1:]) == text  # after <bos>


def test_greedy_output_equals_transformers(
    gemma_llm: LLM, gemma_outputs: list[RequestOutput], references: list[Reference]
) -> None:
    assert len(gemma_outputs[-1].prompt_token_ids) > WINDOW + 100
    for out, ref in zip(gemma_outputs, references, strict=True):
        assert_matches_hf(gemma_llm, out, ref)
        assert_top_logprobs_match(out.outputs[0], ref, 5)
    assert len({tuple(out.outputs[0].token_ids) for out in gemma_outputs}) == len(gemma_outputs)


def test_the_server_gives_the_same_completions(gemma_outputs: list[RequestOutput]) -> None:
    """`llmserve serve gemma-3-270m` and `/v1/completions`: the offline run's text and logprobs."""
    server = RemoteServer([NAME, "--kv-cache-memory", str(KV_POOL), "--dtype", "float32"])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        out = gemma_outputs[-1]  # the long one
        served = client.completions.create(
            model=NAME,
            prompt=PROMPTS[-1],
            max_tokens=NUM_TOKENS,
            temperature=0.0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        ).choices[0]
        assert served.text == out.outputs[0].text
        assert served.logprobs is not None and served.logprobs.token_logprobs is not None
        assert out.outputs[0].logprobs is not None
        for logprob, token, entry in zip(
            served.logprobs.token_logprobs, out.outputs[0].token_ids, out.outputs[0].logprobs
        ):
            assert logprob == pytest.approx(entry[token].logprob, abs=1e-5)
    finally:
        server.stop()
