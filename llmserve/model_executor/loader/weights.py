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
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf.quants import dequantize
from safetensors import safe_open

from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.stored_weight import StoredTensor
from llmserve.model_executor.loader.gguf_file import (
    map_tensor_data,
    read_gguf_header,
    tensor_bytes,
)
from llmserve.model_executor.loader.model_source import ModelSource
from llmserve.model_executor.models.causal_lm import CausalLM
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.registry import (
    GGUF_PERMUTED_QK,
    architecture_from_gguf,
    config_class,
    model_class,
)

if TYPE_CHECKING:
    from llmserve.model_executor.models.bert import BertConfig

logger = logging.getLogger(__name__)

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_model_config(source: ModelSource) -> DecoderConfig | BertConfig:
    """The model's hyper-parameters, read by its architecture's config class; `ValueError` for an
    unreadable checkpoint or an architecture the registry does not know."""
    if source.format == "hf":
        config_path = source.path / "config.json"
        try:
            raw = json.loads(config_path.read_text())
            archs = raw.get("architectures") or []
            arch = archs[0] if archs else f"{str(raw.get('model_type', '?')).capitalize()}ForCausalLM"
            return config_class(arch).from_hf_dict(raw)
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"Cannot read a model config from {config_path}: {e!r}") from e
    header = read_gguf_header(source.path)
    arch = architecture_from_gguf(header)
    return config_class(arch).from_gguf(header, arch)


Weights = Iterator[tuple[str, "torch.Tensor | StoredTensor"]]


def iter_weights(source: ModelSource, stored: bool = False) -> Weights:
    """Yield `(HF parameter name, tensor in HF's shape)`, one at a time: float32 CPU tensors, or with
    `stored` each 2-D weight as a `StoredTensor` of the checkpoint's bytes (needs the C kernels)."""
    if source.format == "hf":
        return _iter_safetensors(source, stored)
    return _iter_gguf(source, stored)


def _iter_safetensors(source: ModelSource, stored: bool) -> Weights:
    config = load_model_config(source)
    tied = isinstance(config, DecoderConfig) and config.tie_word_embeddings
    for file in sorted(source.path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names = f.keys()
            for name in names:
                if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                    continue  # a buffer the model recomputes, or a copy of the embedding
                tensor = f.get_tensor(name)
                if stored and tensor.dim() == 2:
                    is_float = tensor.dtype in (torch.float32, torch.float16, torch.bfloat16)
                    yield name, StoredTensor.from_dense(tensor if is_float else tensor.float())
                else:
                    yield name, tensor.float()


def _iter_gguf(source: ModelSource, stored: bool) -> Weights:
    header = read_gguf_header(source.path)
    architecture = architecture_from_gguf(header)
    model = model_class(architecture)
    config = model.config_class.from_gguf(header, architecture)
    permuted = header.architecture in GGUF_PERMUTED_QK
    data = map_tensor_data(source.path)
    reordered = 0
    for gguf_name, info in header.tensors.items():
        name = _hf_name(gguf_name, source, model)
        raw = tensor_bytes(data, info)
        if stored and len(info.shape) in (2, 3) and native.row_bytes(int(info.qtype), info.shape[-1]) > 0:
            tensor: torch.Tensor = torch.from_numpy(raw)  # the mapped file itself
        else:
            try:
                array = dequantize(raw, info.qtype)
            except NotImplementedError as e:
                raise ValueError(f"Tensor {gguf_name!r} in {source.path}: {e}") from e
            # F32 comes back as a view of the file; the model's copy must not write through to it.
            tensor = model.gguf_tensor(name, torch.from_numpy(np.array(array, dtype=np.float32)))
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            tensor = _unpermute_rows(tensor, heads)  # a copy, in HF's row order
            reordered += tensor.numel() * tensor.element_size()
        # an MoE layer's experts are one 3-D tensor [expert, rows, cols]: each expert's slice is its weight
        experts = range(info.shape[0])
        weights = [(name.format(e), tensor[e]) for e in experts] if "{}" in name else [(name, tensor)]
        for hf_name, weight in weights:
            if weight.dtype == torch.uint8:
                yield hf_name, StoredTensor(int(info.qtype), weight, info.shape[-1])
            elif stored and weight.dim() == 2:
                yield hf_name, StoredTensor.from_dense(weight)
            else:
                yield hf_name, weight
    if stored and reordered:
        logger.info(
            "Copied the q/k rows (%.0f MiB) into Hugging Face's order; the rest is mapped.", reordered / 2**20
        )


def _hf_name(gguf_name: str, source: ModelSource, model: type[CausalLM]) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in model.gguf_layer_names:
        raise ValueError(f"Unexpected tensor {gguf_name!r} in {source.path}.")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{model.gguf_layer_names[part]}.{kind}"


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order.

    HF's rotary embedding pairs row i of a head with row i + head_dim/2; llama.cpp's pairs adjacent
    rows, so its converter moves HF row (head, half, i) to (head, i, half). This moves it back.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
