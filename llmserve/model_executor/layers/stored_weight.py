"""Weights kept as the checkpoint stores them (GGUF blocks, fp16, bf16, fp32), for the CPU kernels.

A 0.5B model in Q4_K_M is 491 MB on disk and ~2 GB widened to fp32; an 8B one 4.9 GB and 32 GB. So on the
CPU each projection keeps its checkpoint's bytes, from the memory-mapped file where the layout allows,
and `kernels/weight_gemm.c` multiplies them in that format at every batch size. A fused projection
(QKV, gate-up) keeps one part per checkpoint shard, since a Q4_K_M file stores V in another type than
Q and K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from llmserve.model_executor.kernels import native

_FLOAT_TYPES = {
    torch.float32: GGMLQuantizationType.F32,
    torch.float16: GGMLQuantizationType.F16,
    torch.bfloat16: GGMLQuantizationType.BF16,
}


@dataclass(frozen=True)
class StoredTensor:
    """A 2-D weight [rows, in_features] as raw bytes [rows, row_bytes] of GGML type `qtype`."""

    qtype: int
    data: torch.Tensor  # uint8 [rows, row_bytes]
    in_features: int

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> StoredTensor:
        """A float tensor [rows, in] as it is: 4 or 2 bytes a weight."""
        tensor = tensor.detach().contiguous()
        qtype = _FLOAT_TYPES.get(tensor.dtype)
        if qtype is None or tensor.dim() != 2:
            raise ValueError(f"Cannot keep a {tensor.dtype} tensor of shape {tuple(tensor.shape)} as stored.")
        return cls(int(qtype), tensor.view(torch.uint8), tensor.shape[1])

    @classmethod
    def rounded(cls, values: torch.Tensor, qtype: GGMLQuantizationType) -> StoredTensor:
        """fp32 values [rows, in] rounded into `qtype` (gguf's quantizer)."""
        return cls(int(qtype), torch.from_numpy(quantize(values.numpy(), qtype)), values.shape[1])

    def dequantize(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `ids` (default: all) as fp32 [n, in_features]."""
        ids = torch.arange(self.rows) if ids is None else ids
        return native.dequantize_rows(self.data, self.qtype, self.in_features, ids)


class StoredWeight:
    """A projection's weight [out, in] as parts of rows stacked, and its bias; called on fp32 rows."""

    def __init__(self, parts: list[StoredTensor], bias: torch.Tensor | None) -> None:
        if not 1 <= len(parts) <= native.MAX_WEIGHT_PARTS:
            raise ValueError(f"A stored weight has 1 to {native.MAX_WEIGHT_PARTS} parts, got {len(parts)}.")
        self.parts = parts
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features = sum(part.rows for part in parts)
        self.native = native.Weight(
            num_parts=len(parts), bias=0 if self.bias is None else self.bias.data_ptr()
        )
        for i, part in enumerate(parts):
            self.native.parts[i] = native.WeightPart(part.data.data_ptr(), part.qtype, part.rows)

    @property
    def qtypes(self) -> set[int]:
        return {part.qtype for part in self.parts}

    @property
    def nbytes(self) -> int:
        return sum(part.data.numel() for part in self.parts)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return native.weight_gemm(x, self.native, self.out_features, out)
