"""The embeddings benchmark's own logic, without running it: its workload, batching, the decoding of
base64 vectors, the report, and the sentence-transformers job (against a fake module: the real one
lives in the peer's own virtual environment)."""

from __future__ import annotations

import base64
import sys
import types
from typing import Any

import numpy as np
import pytest

from benchmarks.common import peer_runner
from benchmarks.embeddings import LENGTH_MIX, Result, Workload, batches, decode_vectors, report
from llmserve.model_executor.loader import load_tokenizer, resolve_model


def test_the_workload_is_seeded_mixed_and_fits_the_model() -> None:
    sentences = Workload(400, seed=0).sentences()
    assert sentences == Workload(400, seed=0).sentences() != Workload(400, seed=1).sentences()
    words = [len(s.split()) for s in sentences]
    assert min(words) >= LENGTH_MIX[0][1] and max(words) <= LENGTH_MIX[-1][2]
    assert sum(w <= 16 for w in words) > 150 and sum(w > 60 for w in words) > 30  # short and long
    tokenizer = load_tokenizer(resolve_model("all-MiniLM-L6-v2"))
    assert max(len(ids) for ids in tokenizer(sentences)["input_ids"]) <= 256  # nobody truncates


def test_batches_keep_every_sentence_in_order() -> None:
    items = [str(i) for i in range(70)]
    split = batches(items, 32)
    assert [len(b) for b in split] == [32, 32, 6] and sum(split, []) == items


def test_base64_vectors_decode_in_input_order() -> None:
    rows = [np.array([1.0, -0.5], dtype="<f4"), np.array([0.25, 2.0], dtype="<f4")]
    data = [{"index": i, "embedding": base64.b64encode(v.tobytes()).decode()} for i, v in enumerate(rows)]
    decoded = decode_vectors({"data": data[::-1]})
    assert [v.tolist() for v in decoded] == [v.tolist() for v in rows]


def test_the_report_gives_each_rate_and_our_ratio() -> None:
    text = report([Result("llmserve", 2000, 10.0), Result("sentence-transformers", 2000, 16.0)])
    assert "200.0" in text and "125.0" in text
    assert text.splitlines()[-1] == "llmserve / sentence-transformers: 1.60x"


class FakeSentenceTransformer:
    def __init__(self, path: str, device: str) -> None:
        assert device == "cpu"

    def encode(self, sentences: list[str], batch_size: int) -> np.ndarray:
        assert batch_size == 32
        return np.zeros((len(sentences), 4), dtype=np.float32)


def test_the_peer_encodes_every_sentence_on_the_given_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[int] = []
    monkeypatch.setitem(
        sys.modules,
        "sentence_transformers",
        types.SimpleNamespace(SentenceTransformer=FakeSentenceTransformer),
    )
    monkeypatch.setattr("torch.set_num_threads", threads.append)
    job: dict[str, Any] = {"model": "folder", "sentences": ["a", "b", "c"], "batch_size": 32, "threads": 2}
    result = peer_runner.RUNNERS["sentence-transformers"](job)
    assert result["sentences"] == 3 and result["elapsed"] >= 0 and threads == [2]
