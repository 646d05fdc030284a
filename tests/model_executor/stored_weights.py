"""Random weights in every stored format the kernels read, real ones from the packaged GGUF models, and
gguf's reading of them as reference."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from llmserve.config import ModelConfig
from llmserve.model_executor.execution_plan import ExecutionPlan
from llmserve.model_executor.layers.stored_weight import StoredTensor
from llmserve.model_executor.loader import resolve_model
from llmserve.model_executor.loader.gguf_file import (
    GGUFTensorInfo,
    map_tensor_data,
    read_gguf_header,
    tensor_bytes,
)

Q = GGMLQuantizationType
QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]  # gguf-py writes these; the K types it only reads
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
FLOATS = [Q.F32, Q.F16, Q.BF16]
ALL_TYPES = QUANTIZABLE + K_TYPES + FLOATS
# Where each K type keeps its fp16 super-block scales (d, and dmin where there is one).
_K_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_stored(qtype: Q, rows: int, cols: int, seed: int = 0, scale: float = 0.1) -> np.ndarray:
    """A random weight [rows, cols] of magnitude about `scale`, stored as `qtype`: bytes [rows, row_bytes].
    The K types get random bits under finite super-block scales (random bytes could be inf or NaN)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, cols)).astype(np.float32) * scale
    if qtype in QUANTIZABLE:
        return quantize(values, qtype)
    if qtype == Q.F32:
        return values.view(np.uint8)
    if qtype == Q.F16:
        return values.astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:  # 6-bit sub-scales times up to 6-bit values: ~1000 x d
        d = (rng.random((rows, cols // block_size)) * scale / 500).astype(np.float16)
        raw[:, :, offset : offset + 2] = d.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def random_stored_tensor(qtype: Q, rows: int, cols: int, seed: int = 0, scale: float = 0.1) -> StoredTensor:
    return StoredTensor(int(qtype), torch.from_numpy(random_stored(qtype, rows, cols, seed, scale)), cols)


def reference(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """gguf's fp32 values of stored bytes."""
    if qtype == Q.BF16:  # gguf's bf16 reader, spelled out: the high half of an fp32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return dequantize(raw, qtype)


# Real blocks: a few tensors of each type in the two models the install step provides, as pytest
# parameters (model, GGUF tensor name, the type the file stores it in).
QWEN = "qwen2.5-coder-0.5b-instruct"  # Q4_K_M: Q4_K and Q6_K ffn_down, Q5_0, Q8_0 attn_v and output
SMOLLM = "smollm2-135m-instruct"  # Q4_1
REAL_TENSORS = [
    pytest.param(model, name, qtype, id=f"{qtype.name}-{name.removesuffix('.weight')}")
    for model, name, qtype in [
        (QWEN, "blk.5.ffn_down.weight", Q.Q4_K),
        (QWEN, "blk.23.ffn_down.weight", Q.Q4_K),
        (QWEN, "blk.0.ffn_down.weight", Q.Q6_K),
        (QWEN, "blk.21.ffn_down.weight", Q.Q6_K),
        (QWEN, "blk.0.attn_q.weight", Q.Q5_0),
        (QWEN, "token_embd.weight", Q.Q5_0),
        (QWEN, "blk.0.attn_v.weight", Q.Q8_0),
        (QWEN, "output.weight", Q.Q8_0),
        (SMOLLM, "blk.0.ffn_down.weight", Q.Q4_1),
        (SMOLLM, "blk.29.attn_q.weight", Q.Q4_1),
    ]
]
real_tensors = pytest.mark.parametrize(("model", "name", "qtype"), REAL_TENSORS)
# The products are tested on the first tensor of each type: a product reads blocks as dequantization
# does, so a second tensor adds run time more than cases.
real_tensor_per_type = pytest.mark.parametrize(("model", "name", "qtype"), REAL_TENSORS[::2])


@functools.cache
def _gguf_tensors(model: str) -> tuple[dict[str, GGUFTensorInfo], np.ndarray]:
    """The tensor table and the memory-mapped bytes of a packaged model; fails (not skips) without it,
    since `make install` provides both models."""
    try:
        path = resolve_model(model).path
    except ValueError as e:
        pytest.fail(str(e))
    return read_gguf_header(path).tensors, map_tensor_data(path)


@functools.cache
def real_stored_tensor(model: str, name: str, qtype: Q, rows: int = 37) -> StoredTensor:
    """`rows` rows spread evenly over a real tensor, as its bytes: real blocks with the scales and
    quants a trained model has (37: no multiple of any kernel tile). Fails if the file stores the
    tensor in another type than `qtype`."""
    tensors, data = _gguf_tensors(model)
    info = tensors[name]
    assert info.qtype == qtype, f"{model} stores {name} as {info.qtype.name}"
    picked = np.linspace(0, info.shape[0] - 1, rows).round().astype(np.int64)
    raw = np.ascontiguousarray(tensor_bytes(data, info)[picked])  # reads only these rows
    assert raw.any(), "real blocks are not all zero"
    return StoredTensor(int(qtype), torch.from_numpy(raw), info.shape[1])


def cpu_plan(quantization: str = "none", stored: bool = True) -> ExecutionPlan:
    """The plan the model runner makes on this CPU in fp32: stored weights through our kernels, or with
    `stored=False` dense ones (as without the C kernels)."""
    config = ModelConfig(quantization=quantization, native_kernels=stored)  # type: ignore[arg-type]
    return ExecutionPlan.decide(config, torch.device("cpu"), torch.float32, "LlamaForCausalLM")
