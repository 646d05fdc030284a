"""A model's config and its weights, under Hugging Face names, from either checkpoint format.

Weights are yielded one tensor at a time, so the whole checkpoint is never held twice: as float32 on
the CPU for a model that copies each into its own dtype and device (float32 is lossless for every
format we read), or, for the CPU kernels, each 2-D weight as the checkpoint stores it (`StoredTensor`).
A GGUF's blocks are then views of the memory-mapped file: nothing is copied, the page cache holds
them once for every engine process on the machine, and start-up reads only the header.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize
from safetensors import safe_open

from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.stored_weight import StoredTensor
from llmserve.model_executor.loader.gguf_file import (
    GGUFHeader,
    map_tensor_data,
    read_gguf_header,
    tensor_bytes,
)
from llmserve.model_executor.loader.model_source import ModelSource
from llmserve.model_executor.models.llama_config import LlamaConfig

logger = logging.getLogger(__name__)

_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# llama.cpp's converter interleaves the rows of q_proj and k_proj for these (see _unpermute_rows)
_PERMUTED_ARCHITECTURES = ("llama", "mistral")

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

_HF_NAME = re.compile(
    r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight"
    r"|model\.layers\.\d+\.(self_attn\.[qkvo]_proj\.(weight|bias)|mlp\.(gate|up|down)_proj\.weight"
    r"|(input|post_attention)_layernorm\.weight)"
)


def load_model_config(source: ModelSource) -> LlamaConfig:
    """The model's hyper-parameters; `ValueError` for an unreadable or unsupported checkpoint."""
    if source.format == "hf":
        config_path = source.path / "config.json"
        try:
            return LlamaConfig.from_hf_dict(json.loads(config_path.read_text()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"Cannot read a model config from {config_path}: {e!r}") from e
    return _gguf_config(read_gguf_header(source.path))


def _gguf_config(header: GGUFHeader) -> LlamaConfig:
    arch = header.architecture
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"Unsupported architecture {arch!r} in {header.path}; "
            f"llmserve reads GGUF files of {', '.join(_GGUF_ARCHITECTURES)}."
        )
    if "rope_freqs.weight" in header.tensors:
        raise ValueError(f"{header.path} uses per-frequency rope factors (rope_freqs), not supported yet.")
    meta = header.metadata

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{header.path} lacks the metadata key {arch}.{key!r}.")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    vocab_size = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    if not vocab_size:
        raise ValueError(f"{header.path} states no vocabulary size and has no tokenizer.ggml.tokens.")
    return LlamaConfig(
        architecture=_GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(head_dim or hidden // num_heads),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in header.tensors,
        attention_bias="blk.0.attn_q.bias" in header.tensors,
        rope_scaling=_gguf_rope_scaling(meta, arch),
    )


def _gguf_rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """llama.cpp's rope scaling keys, spelled as HF's `rope_scaling` dict."""
    rope_type = meta.get(f"{arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": factor}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


Weights = Iterator[tuple[str, "torch.Tensor | StoredTensor"]]


def iter_weights(source: ModelSource, stored: bool = False) -> Weights:
    """Yield `(HF parameter name, tensor in HF's shape)`, one at a time: float32 CPU tensors, or with
    `stored` each 2-D weight as a `StoredTensor` of the checkpoint's bytes (needs the C kernels)."""
    if source.format == "hf":
        return _iter_safetensors(source, stored)
    return _iter_gguf(source, stored)


def _iter_safetensors(source: ModelSource, stored: bool) -> Weights:
    tied = load_model_config(source).tie_word_embeddings
    for file in sorted(source.path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names = f.keys()
            for name in names:
                if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                    continue  # a buffer the model recomputes, or a copy of the embedding
                if not _HF_NAME.fullmatch(name):
                    raise ValueError(f"Unexpected tensor {name!r} in {file}.")
                tensor = f.get_tensor(name)
                if stored and tensor.dim() == 2:
                    is_float = tensor.dtype in (torch.float32, torch.float16, torch.bfloat16)
                    yield name, StoredTensor.from_dense(tensor if is_float else tensor.float())
                else:
                    yield name, tensor.float()


def _iter_gguf(source: ModelSource, stored: bool) -> Weights:
    header = read_gguf_header(source.path)
    config = _gguf_config(header)
    permuted = header.architecture in _PERMUTED_ARCHITECTURES
    data = map_tensor_data(source.path)
    reordered = 0
    for gguf_name, info in header.tensors.items():
        name = _hf_name(gguf_name, source)
        raw = tensor_bytes(data, info)
        if stored and len(info.shape) == 2 and native.row_bytes(int(info.qtype), info.shape[1]) > 0:
            tensor: torch.Tensor = torch.from_numpy(raw)  # the mapped file itself
        else:
            try:
                array = dequantize(raw, info.qtype)
            except NotImplementedError as e:
                raise ValueError(f"Tensor {gguf_name!r} in {source.path}: {e}") from e
            # F32 comes back as a view of the file; the model's copy must not write through to it.
            tensor = torch.from_numpy(np.array(array, dtype=np.float32))
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            tensor = _unpermute_rows(tensor, heads)  # a copy, in HF's row order
            reordered += tensor.numel() * tensor.element_size()
        if tensor.dtype == torch.uint8:
            yield name, StoredTensor(int(info.qtype), tensor, info.shape[1])
        elif stored and tensor.dim() == 2:
            yield name, StoredTensor.from_dense(tensor)
        else:
            yield name, tensor
    if stored and reordered:
        logger.info(
            "Copied the q/k rows (%.0f MiB) into Hugging Face's order; the rest is mapped.", reordered / 2**20
        )


def _hf_name(gguf_name: str, source: ModelSource) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        raise ValueError(f"Unexpected tensor {gguf_name!r} in {source.path}.")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order.

    HF's rotary embedding pairs row i of a head with row i + head_dim/2; llama.cpp's pairs adjacent
    rows, so its converter moves HF row (head, half, i) to (head, i, half). This moves it back.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
