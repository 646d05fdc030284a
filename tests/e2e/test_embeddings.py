"""Embeddings against `transformers` on the same weights: all-MiniLM-L6-v2 (BertModel, mean pooling, L2)
through `LLM.embed`, batched and one prompt at a time; and a decoder's last-token pooling (a tiny random
Llama, `runner="pooling"`), through chunked prefill and the prefix cache."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from benchmarks.embeddings import Workload
from llmserve import LLM, PoolingParams
from llmserve.model_executor.loader import resolve_model

MINILM = "all-MiniLM-L6-v2"
MIN_COSINE = 0.99999
# Mixed lengths (4 to 180 words, up to ~200 tokens), with some text that is not plain words.
SENTENCES = [
    "Café au lait, s'il vous plaît!",
    "The 3.14159 digits of π; and 42 — the answer?",
    "Hyphenated-words, CamelCaseWords, snake_case_words and ALL CAPS.",
    "a",
    *Workload(96, seed=7).sentences(),
]


@pytest.fixture(scope="module")
def minilm() -> Iterator[LLM]:
    llm = LLM(MINILM, multiprocess=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference() -> list[torch.Tensor]:
    """transformers' BertModel, mean pooling over the attention mask, L2: sentence-transformers' recipe."""
    from transformers import AutoModel, AutoTokenizer

    path = resolve_model(MINILM).path
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    vectors: list[torch.Tensor] = []
    with torch.no_grad():
        for i in range(0, len(SENTENCES), 32):
            batch = tokenizer(SENTENCES[i : i + 32], padding=True, return_tensors="pt")
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"][..., None].float()
            vectors.extend(F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
    return vectors


def cosines(ours: list[list[float]], reference: list[torch.Tensor]) -> torch.Tensor:
    return F.cosine_similarity(torch.tensor(ours), torch.stack(reference), dim=-1)


def test_minilm_batched_equals_transformers(minilm: LLM, reference: list[torch.Tensor]) -> None:
    outputs = minilm.embed(SENTENCES, use_tqdm=False)
    assert [o.request_id for o in outputs] == sorted((o.request_id for o in outputs), key=int)
    assert all(o.finished and o.outputs.hidden_size == 384 for o in outputs)
    assert outputs[3].prompt_token_ids == [101, 1037, 102]  # [CLS] a [SEP]
    assert max(len(o.prompt_token_ids) for o in outputs) > 150  # long ones too
    assert cosines([o.outputs.embedding for o in outputs], reference).min() >= MIN_COSINE


def test_minilm_one_at_a_time_equals_transformers(minilm: LLM, reference: list[torch.Tensor]) -> None:
    ours = [minilm.embed(s, use_tqdm=False)[0].outputs.embedding for s in SENTENCES]
    assert cosines(ours, reference).min() >= MIN_COSINE


def test_minilm_truncates_from_the_left_keeping_special_tokens(minilm: LLM) -> None:
    text = " ".join(f"w{i}" for i in range(300))  # ~600 tokens, past max_model_len (256)
    kept = minilm.embed(text, truncate_prompt_tokens=8, use_tqdm=False)[0]
    full = minilm.get_tokenizer().encode(text)
    assert kept.prompt_token_ids == [101, *full[-7:-1], 102]
    whole = PoolingParams(truncate_prompt_tokens=-1)  # max_model_len
    assert len(minilm.embed(text, pooling_params=whole, use_tqdm=False)[0].prompt_token_ids) == 256
    raw_params = PoolingParams(normalize=False)
    raw = minilm.embed("Not normalised.", pooling_params=raw_params, use_tqdm=False)[0]
    assert torch.tensor(raw.outputs.embedding).norm() > 1.5


def test_minilm_refuses_what_it_cannot_do(minilm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len is 256"):
        minilm.embed(" ".join(["word"] * 300), use_tqdm=False)
    with pytest.raises(ValueError, match="^dimensions"):
        minilm.embed("x", pooling_params=PoolingParams(dimensions=64), use_tqdm=False)
    with pytest.raises(ValueError, match="^model serves embeddings"):
        minilm.generate("x", use_tqdm=False)
    with pytest.raises(ValueError, match="^truncate_prompt_tokens"):
        minilm.embed("x", truncate_prompt_tokens=257, use_tqdm=False)


@pytest.fixture(scope="module")
def tiny_pooling(tiny_llama_hf_dir: Path) -> Iterator[LLM]:
    """A 32-token step budget, so that longer prompts are pooled after several chunks."""
    llm = LLM(
        str(tiny_llama_hf_dir),
        runner="pooling",
        multiprocess=False,
        max_num_batched_tokens=32,
        kv_cache_memory=8 << 20,
    )
    yield llm
    llm.shutdown()


def last_hidden_normalised(folder: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModel

    model: Any = AutoModel.from_pretrained(folder).eval()  # LlamaModel: the final norm's output
    with torch.no_grad():
        return [F.normalize(model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1) for p in prompts]


def test_decoder_pools_its_last_token_as_transformers(tiny_llama_hf_dir: Path, tiny_pooling: LLM) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (1, 7, 40, 100)]
    expected = last_hidden_normalised(tiny_llama_hf_dir, prompts)
    batched = tiny_pooling.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    alone = tiny_pooling.embed({"prompt_token_ids": prompts[0]}, use_tqdm=False)  # a decode-only step
    again = tiny_pooling.embed({"prompt_token_ids": prompts[3]}, use_tqdm=False)  # its blocks are cached
    ours = [o.outputs.embedding for o in [*batched, *alone, *again]]
    assert cosines(ours, [*expected, expected[0], expected[3]]).min() >= MIN_COSINE
    stats = tiny_pooling.llm_engine.engine_core.engine_core.scheduler.make_stats()  # type: ignore[attr-defined]
    assert stats.prefix_cache_hits >= 96  # the repeated prompt's six whole blocks
    assert stats.num_free_blocks == stats.num_total_blocks  # nothing kept after a request


def test_a_generate_engine_embeds_nothing(tiny_llama_hf_dir: Path) -> None:
    llm = LLM(str(tiny_llama_hf_dir), multiprocess=False, kv_cache_memory=8 << 20)
    try:
        with pytest.raises(ValueError, match="^model serves generation"):
            llm.embed("x", use_tqdm=False)
    finally:
        llm.shutdown()
