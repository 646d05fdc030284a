"""RMSNorm, computed in fp32 whatever the weights' dtype (as Hugging Face does).

Gemma's norms multiply by (1 + w) where Llama's multiply by w (`offset=1.0`), in fp32 before the cast
back, as Hugging Face's Gemma does; the checkpoint holds w either way.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Hugging Face's own formula: the same results as F.rms_norm, which was several times slower on
        # a prefill chunk on the CPU.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)
