"""Rotary position embeddings (the rotate-half layout of Hugging Face checkpoints), with the config's
scaling applied to the inverse frequencies once, at construction."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

RopeAngles = tuple[torch.Tensor, torch.Tensor]  # cos, sin: each [num_tokens, 1, head_dim // 2]


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"Unsupported rope scaling type {kind!r}; supported: default, linear, llama3.")


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.compute_tables()

    def compute_tables(self) -> None:
        """(Re)build the cos/sin tables in fp32 on the module's device, e.g. after `to_empty()`."""
        device = self.get_buffer("cos").device
        if device.type == "meta":
            return
        inv_freq = _inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def forward(self, positions: torch.Tensor) -> RopeAngles:
        """The cos/sin rows for these positions, looked up once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, angles: RopeAngles) -> torch.Tensor:
    """Rotate q [num_tokens, heads, head_dim] or k by their positions' angles (rotate-half layout)."""
    cos, sin = angles
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
