"""Pooling over ragged spans of a flat batch, the sentence-transformers files that choose it, and
`PoolingParams`' validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmserve.model_executor.loader import resolve_model
from llmserve.model_executor.loader.sentence_transformers import (
    load_pooler_config,
    read_sentence_transformers,
)
from llmserve.model_executor.pooler import Pooler, PoolerConfig, PoolingSpan, vector_bytes
from llmserve.pooling_params import PoolingParams

# Three prompts of ragged lengths, packed with two rows of another request between the last two.
SPANS = [PoolingSpan(0, 1), PoolingSpan(1, 5), PoolingSpan(8, 3)]


@pytest.fixture
def hidden() -> torch.Tensor:
    return torch.randn(11, 6, generator=torch.Generator().manual_seed(0))


def expected(hidden: torch.Tensor, kind: str) -> torch.Tensor:
    """One span at a time, the way sentence-transformers reads a padded batch."""
    rows = [hidden[s.start : s.start + s.length] for s in SPANS]
    if kind == "MEAN":
        return torch.stack([r.mean(0) for r in rows])
    return torch.stack([r[0] if kind == "CLS" else r[-1] for r in rows])


@pytest.mark.parametrize("kind", ["MEAN", "CLS", "LAST"])
def test_each_pooling_reads_only_its_spans_rows(hidden: torch.Tensor, kind: str) -> None:
    raw = Pooler(PoolerConfig(kind, normalize=False))(hidden, SPANS)  # type: ignore[arg-type]
    torch.testing.assert_close(raw, expected(hidden, kind), rtol=0, atol=1e-6)
    normed = Pooler(PoolerConfig(kind, normalize=True))(hidden, SPANS)  # type: ignore[arg-type]
    torch.testing.assert_close(normed, F.normalize(expected(hidden, kind), dim=-1), rtol=0, atol=1e-6)


def test_a_request_overrides_the_models_normalisation(hidden: torch.Tensor) -> None:
    spans = [PoolingSpan(s.start, s.length, normalize) for s, normalize in zip(SPANS, (False, None, True))]
    out = Pooler(PoolerConfig("MEAN", normalize=True))(hidden, spans)
    mean = expected(hidden, "MEAN")
    torch.testing.assert_close(out[0], mean[0])
    torch.testing.assert_close(out[1:], F.normalize(mean[1:], dim=-1))


def test_vectors_travel_as_little_endian_float32() -> None:
    vectors = torch.tensor([[1.5, -2.0], [0.25, 3.0]])
    assert [np.frombuffer(b, dtype="<f4").tolist() for b in vector_bytes(vectors)] == vectors.tolist()


def write_st(folder: Path, pooling: dict[str, object], modules: list[str], max_seq_length: int = 128) -> Path:
    """A sentence-transformers folder's files: modules.json, 1_Pooling/config.json, sentence_bert_config."""
    entries = [
        {
            "idx": i,
            "name": str(i),
            "path": "1_Pooling" if kind == "Pooling" else "",
            "type": f"st.models.{kind}",
        }
        for i, kind in enumerate(modules)
    ]
    (folder / "modules.json").write_text(json.dumps(entries))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **pooling}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return folder


@pytest.mark.parametrize(
    ("pooling", "kind"),
    [
        ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "MEAN"),
        ({"pooling_mode_cls_token": True}, "CLS"),
        ({"pooling_mode_lasttoken": True}, "LAST"),
        ({"pooling_mode": "lasttoken"}, "LAST"),
    ],
)
def test_sentence_transformers_files_choose_the_pooling(
    tmp_path: Path, pooling: dict[str, object], kind: str
) -> None:
    found = read_sentence_transformers(
        write_st(tmp_path, pooling, ["Transformer", "Pooling", "Normalize"], 77)
    )
    assert found is not None and found.pooler == PoolerConfig(kind, normalize=True)  # type: ignore[arg-type]
    assert found.max_seq_length == 77
    without = read_sentence_transformers(write_st(tmp_path, pooling, ["Transformer", "Pooling"]))
    assert without is not None and not without.pooler.normalize


def test_modules_we_do_not_compute_are_refused(tmp_path: Path) -> None:
    mean: dict[str, object] = {"pooling_mode_mean_tokens": True}
    with pytest.raises(ValueError, match="Dense"):
        read_sentence_transformers(write_st(tmp_path, mean, ["Transformer", "Pooling", "Dense", "Normalize"]))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_sentence_transformers(write_st(tmp_path, {**mean, "pooling_mode_max_tokens": True}, ["Pooling"]))


def test_without_the_files_vllms_defaults(tmp_path: Path) -> None:
    assert read_sentence_transformers(tmp_path) is None
    assert load_pooler_config(tmp_path, encoder=True).pooler == PoolerConfig("CLS", True)
    assert load_pooler_config(None, encoder=False).pooler == PoolerConfig("LAST", True)


def test_the_packaged_minilm_pools_by_mean_and_normalises() -> None:
    source = resolve_model("all-MiniLM-L6-v2")  # its short name, or its folder
    assert source.format == "hf" and resolve_model(str(source.path)).path == source.path
    found = read_sentence_transformers(source.path)
    assert found is not None
    assert found.pooler == PoolerConfig("MEAN", normalize=True) and found.max_seq_length == 256


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
        ({"dimensions": 0}, "dimensions"),
        ({"normalize": 1}, "normalize"),
    ],
)
def test_pooling_params_name_the_bad_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        PoolingParams(**kwargs)  # type: ignore[arg-type]
    assert PoolingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
