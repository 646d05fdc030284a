"""Random weights in every stored format the kernels read, and gguf's reading of them as reference."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from llmserve.model_executor.layers.stored_weight import StoredTensor

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
