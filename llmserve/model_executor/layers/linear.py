"""Linear layers whose CPU kernel is chosen once, after the weights are loaded.

- fp32 through our C kernel with the weight packed once (`kernels/gemm.c`), where the kernels build:
  measured here 1.2-1.5x oneDNN's throughput at 9-128 rows and as fast or faster above, and a row's
  result does not depend on its batch. Else oneDNN with the weight pre-packed: PyTorch's default CPU
  path (MKL sgemm) is slow for the short, wide products of decoding (a few to a few dozen rows against a
  large weight), especially on AMD CPUs: measured here 2-4x slower than oneDNN at 8-64 rows.
- `fp16`: weights stored in fp16, computed in fp32 (fbgemm). Decode is bandwidth-bound, so halving the
  weight bytes nearly halves a small batch's step (measured here: 2x at 1 row, 1.2x at 64 rows).
  For int8/int4 see `quantization.py`: PyTorch's weight-only int8/int4 CPU kernels
  (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) measured 5-50x slower than fp32 here, and
  fbgemm's int8 dynamic linear (one activation scale per call) drifts ~0.6-1.6 nats per token on
  SmolLM2, so neither is used.
- GGUF blocks, for a few rows: a GGUF model's Q4_1/Q8_0 weights are kept as loaded too, and decode
  steps of up to `BLOCK_ROWS` rows read those (5 or 8.5 bits a weight, not 32) through our C kernel,
  which widens them to exactly the fp32 values the other kernels use (3.7x faster at 1 row here).
  `--quantization int8|int4` round the activations to int8 per block as well, as llama.cpp does, so
  that the kernel multiplies integers (see `kernels/block_q8.c`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.config import Quantization
from llmserve.model_executor.kernels import native

BLOCK_ROWS = 8  # up to here block_gemv beats oneDNN fp32 on this machine's 2 cores (measured to 16)


class LinearKernel(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Linear(nn.Linear):
    kernel: LinearKernel | None = None

    def prepare(self, quantization: Quantization, native_kernels: bool) -> None:
        """After the weights are loaded. A kernel keeps its own copy, so the plain weight is freed."""
        self.kernel = make_kernel(self.weight, self.bias, quantization, native_kernels)
        if self.kernel is not None:
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self.bias)


def make_kernel(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: Quantization, native_kernels: bool
) -> LinearKernel | None:
    """The fastest kernel for this weight, or None for plain `F.linear` (GPUs, reduced precision).
    `native_kernels`: our C kernels loaded (see `kernels/native.py`) and may be used."""
    on_cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if quantization == "fp16":
        if not on_cpu_fp32:
            raise ValueError("quantization='fp16' runs on CPU with dtype float32 only.")
        return Fp16WeightKernel(weight, bias)
    if on_cpu_fp32 and native_kernels:
        return PackedKernel(weight, bias)
    if on_cpu_fp32 and torch.backends.mkldnn.is_available():
        return OneDNNKernel(weight, bias)
    return None


class OneDNNKernel:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PackedKernel:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = native.pack_weight(weight)
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else bias.detach().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return native.gemm(x, self.packed, self.out_features, self.bias)


class Fp16WeightKernel:
    """fp16 weights, fp32 inputs, outputs and accumulation: half the bytes a decode step streams."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        bias = None if bias is None else bias.detach()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach(), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


class BlockKernel:
    """With `int8_activations`, the inputs are rounded per block of 32 at every batch size: in C for the
    few rows the blocks take, by `round_activations` before the larger batches' kernel."""

    def __init__(
        self,
        blocks: torch.Tensor,
        qtype: int,
        out_features: int,
        bias: torch.Tensor | None,
        large: LinearKernel,
        int8_activations: bool = False,
    ) -> None:
        self.blocks = blocks
        self.qtype = qtype
        self.out_features = out_features
        self.bias = None if bias is None else bias.detach()
        self.large = large
        self.int8_activations = int8_activations

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > BLOCK_ROWS:
            return self.large(round_activations(x) if self.int8_activations else x)
        y = native.block_gemv(x, self.blocks, self.qtype, self.out_features, self.int8_activations)
        return y if self.bias is None else y + self.bias


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] with each block of 32 rounded to int8 and back, by the code that rounds the rows
    `kernels/block_q8.c` multiplies (`round_rows`: scale max|x| / 127, round half to even)."""
    return native.round_rows(x)
