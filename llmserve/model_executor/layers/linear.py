"""Linear layers: a dense weight for PyTorch, or the checkpoint's stored weight for our CPU kernels.

Which one, and which kernel multiplies it, is the execution plan's decision (`execution_plan.py`).
- Stored: the weight stays as the checkpoint stores it (`stored_weight.py`). `--quantization gguf`
  rounds the activations to int8 per block of 32, as llama.cpp does, and `int8|int4` round the weights
  into Q8_0/Q4_1 blocks at load too (`quantization.py`); `fp16` keeps 2-byte weights.
- Dense: `F.linear`, through oneDNN with the weight pre-packed on the CPU in fp32, which PyTorch's
  default path (MKL sgemm) trails for the short, wide products of decoding.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model_executor.execution_plan import DenseProduct, ExecutionPlan, StoredProduct
from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.stored_weight import StoredTensor, StoredWeight


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

    @property
    def num_parameters(self) -> int:
        return self.out_features * self.in_features + (0 if self.bias is None else self.out_features)

    def prepare(self, plan: ExecutionPlan) -> None:
        """After the weights are loaded: the kernel the plan gives this weight."""
        if self.stored:
            parts = [part for part in self.parts if part is not None]
            self.kernel = StoredKernel(StoredWeight(parts, self.bias), plan)
        elif self.weight is not None:
            self.kernel = dense_kernel(self.weight, self.bias, plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def forward_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """gelu(x W^T + b), the exact (erf) GELU: one oneDNN call where that is the kernel, which spares
        writing and reading the product once more."""
        if isinstance(self.kernel, OneDNNKernel):
            return self.kernel.fused(x, "gelu")
        return F.gelu(self(x))

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x W^T + b + residual: one oneDNN call where that is the kernel."""
        if isinstance(self.kernel, OneDNNKernel):
            return self.kernel.fused(x, "add", residual)
        return self(x) + residual


def dense_kernel(weight: torch.Tensor, bias: torch.Tensor | None, plan: ExecutionPlan) -> LinearKernel | None:
    """oneDNN's where the plan says so, else None for `F.linear`."""
    return OneDNNKernel(weight, bias) if plan.dense_product() is DenseProduct.ONEDNN else None


class OneDNNKernel:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def fused(self, x: torch.Tensor, post_op: str, other: torch.Tensor | None = None) -> torch.Tensor:
        """The product followed by `post_op`: "gelu" (erf) or "add" (of `other`), in the same call."""
        if post_op == "add":
            assert other is not None
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "add")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, post_op, [], "none")


class StoredKernel:
    """A stored weight, multiplied by the kernel the plan gives each batch size."""

    def __init__(self, weight: StoredWeight, plan: ExecutionPlan) -> None:
        self.weight = weight
        self.plan = plan

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T, into `out` (of the product's shape) where given."""
        if x.dim() != 2:
            flat = None if out is None else out.view(-1, out.shape[-1])
            return self(x.reshape(-1, x.shape[-1]), flat).reshape(*x.shape[:-1], -1)
        product = self.plan.stored_product(x.shape[0])
        if product is StoredProduct.WEIGHT_GEMM:
            return self.weight(x, out)
        if product is StoredProduct.BLOCKS_AS_INTEGERS:
            return native.block_gemv(x, self.weight.native, self.weight.out_features, out)
        if product is StoredProduct.INT8_GEMM:
            y = native.int8_gemm(x, self.weight.native, self.weight.out_features, out)
            if y is not None:
                return y
        return self.weight(native.round_rows(x), out)
