"""Linear layers: a dense weight for PyTorch, or the checkpoint's stored weight for our CPU kernels.

- Stored (CPU, fp32 activations, our C kernels built): the weight stays as the checkpoint stores it
  (`stored_weight.py`) and `kernels/weight_gemm.c` multiplies it in that format at every batch size.
  `--quantization gguf` rounds the activations to int8 per block of 32, as llama.cpp does, and `int8|int4`
  round the weights into Q8_0/Q4_1 blocks at load too (`quantization.py`); `fp16` keeps 2-byte weights.
- Dense otherwise (GPUs, bf16/fp16 compute, no C compiler): `F.linear`, through oneDNN with the weight
  pre-packed on the CPU, which PyTorch's default path (MKL sgemm) trails for the short, wide products of
  decoding.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.stored_weight import StoredTensor, StoredWeight

# With int8 activations, decode steps of up to this many rows multiply the blocks as integers (block_q8.c);
# larger ones round the activations the same way and go through weight_gemm.c. At 16 rows block_q8.c
# still takes 0.4-0.9x weight_gemm.c's time on Zen 5 (Q5_0 0.9x, Q4_K 0.45x).
BLOCK_ROWS = native.BLOCK_GEMV_MAX_ROWS


class LinearKernel(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Linear(nn.Module):
    """y = x W^T (+ b). With `stored`, W arrives as one `StoredTensor` per checkpoint shard (`parts`)
    and there is no dense parameter at all."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, stored: bool, shards: int = 1
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = None if stored else nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.parts: list[StoredTensor | None] = [None] * shards if stored else []
        self.kernel: LinearKernel | None = None

    @property
    def stored(self) -> bool:
        return self.weight is None

    def prepare(self, int8_activations: bool = False) -> None:
        """After the weights are loaded: the stored weight's kernel, or oneDNN's for a dense fp32 one."""
        if self.stored:
            parts = [part for part in self.parts if part is not None]
            self.kernel = StoredKernel(StoredWeight(parts, self.bias), int8_activations)
        elif self.weight is not None:
            self.kernel = dense_kernel(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)


def dense_kernel(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearKernel | None:
    """oneDNN's for an fp32 weight on the CPU, else None for `F.linear`."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return OneDNNKernel(weight, bias)
    return None


class OneDNNKernel:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class StoredKernel:
    """With `int8_activations`, up to BLOCK_ROWS rows multiply the blocks as integers (`kernels/block_q8.c`),
    more too where the CPU has AVX-512 VNNI (`int8_gemm.c`), else they are rounded the same way first:
    every batch size multiplies the same values."""

    def __init__(self, weight: StoredWeight, int8_activations: bool = False) -> None:
        self.weight = weight
        self.int8_activations = int8_activations
        self.many_rows_as_integers = int8_activations and native.int8_gemm_available()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.int8_activations:
            return self.weight(x)
        if x.dim() == 2 and x.shape[0] <= BLOCK_ROWS:
            return native.block_gemv(x, self.weight.native, self.weight.out_features)
        if x.dim() == 2 and self.many_rows_as_integers:
            y = native.int8_gemm(x, self.weight.native, self.weight.out_features)
            if y is not None:
                return y
        return self.weight(native.round_rows(x))
