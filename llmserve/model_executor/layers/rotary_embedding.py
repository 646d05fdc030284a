"""Rotary position embeddings (the rotate-half layout of Hugging Face checkpoints), with the config's
scaling applied once, when the cos/sin tables are built.

A table row depends on its position alone, so a key is rotated the same whichever step computes it, as
prefix caching and chunked prefill need. For LongRoPE (Phi-3's "longrope", "su" in older configs) that
means the short factors before `original_max_position_embeddings` and the long ones from there on. Hugging
Face's generate() instead rotates a whole sequence with one set, re-rotating every cached key with the
long factors once the sequence grows past the original context (Phi3ForCausalLM's
prepare_inputs_for_generation); vLLM picks one set at load (the long one whenever max_model_len exceeds
the original context). Ours agrees with Hugging Face on every sequence that stays within the original
context; one that grows past it keeps its earlier keys as the short factors rotated them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

RopeAngles = tuple[torch.Tensor, torch.Tensor]  # cos, sin: each [num_tokens, 1, rotary_dim // 2]


def _rope_type(scaling: dict[str, Any] | None) -> str:
    return str((scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default")


def _inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = _rope_type(scaling)
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
    raise ValueError(
        f"Unsupported rope scaling type {kind!r}; supported: default, linear, llama3, longrope (su)."
    )


def _longrope_factors(scaling: dict[str, Any], rotary_dim: int, name: str) -> torch.Tensor:
    factors = scaling.get(name)
    if not isinstance(factors, list) or len(factors) != rotary_dim // 2:
        raise ValueError(
            f"rope_scaling.{name} must list {rotary_dim // 2} factors (rotary dim / 2), got {factors!r}."
        )
    return torch.tensor(factors, dtype=torch.float32)


def _longrope_freqs(
    rotary_dim: int,
    max_positions: int,
    rows: int,
    theta: float,
    scaling: dict[str, Any],
    device: torch.device,
) -> tuple[torch.Tensor, float]:
    """Angles [rows, rotary_dim // 2] (short factors, then long ones from the original context on) and
    the factor every cos/sin is multiplied by (Hugging Face's attention_factor)."""
    if "original_max_position_embeddings" not in scaling:
        raise ValueError("rope_scaling of type longrope needs original_max_position_embeddings.")
    original = int(scaling["original_max_position_embeddings"])
    theta_powers = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    short = (1.0 / (_longrope_factors(scaling, rotary_dim, "short_factor") * theta_powers)).to(device)
    long = (1.0 / (_longrope_factors(scaling, rotary_dim, "long_factor") * theta_powers)).to(device)
    positions = torch.arange(rows, dtype=torch.float32, device=device)
    freqs = torch.cat([torch.outer(positions[:original], short), torch.outer(positions[original:], long)])
    factor = float(scaling.get("factor") or max_positions / original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return freqs, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_positions), over the first `rotary_dim` dimensions of each
    head (all of them unless the config rotates only part, as Phi-4-mini's 0.75)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,  # the model's max_position_embeddings (LongRoPE's default factor reads it)
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even, in (0, head_dim={head_dim}]; got {self.rotary_dim}.")
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.compute_tables()

    def compute_tables(self, num_positions: int | None = None) -> None:
        """(Re)build the cos/sin tables in fp32 on the module's device, e.g. after `to_empty()`, for
        positions [0, num_positions): the engine's max_model_len, which may be far below the model's
        (a 131k-position table of head_dim 256 takes 128 MiB)."""
        device = self.get_buffer("cos").device
        if device.type == "meta":
            return
        rows = num_positions or self.max_positions
        if _rope_type(self.scaling) in ("longrope", "su"):
            assert self.scaling is not None
            freqs, factor = _longrope_freqs(
                self.rotary_dim, self.max_positions, rows, self.theta, self.scaling, device
            )
        else:
            inv_freq = _inv_freq(self.rotary_dim, self.theta, self.scaling).to(device)
            positions = torch.arange(rows, dtype=torch.float32, device=device)
            freqs, factor = torch.outer(positions, inv_freq), 1.0
        # [rows, rotary_dim // 2]
        self.cos = freqs.cos() * factor
        self.sin = freqs.sin() * factor

    def forward(self, positions: torch.Tensor) -> RopeAngles:
        """The cos/sin rows for these positions, looked up once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, angles: RopeAngles) -> torch.Tensor:
    """Rotate q [num_tokens, heads, head_dim] or k by their positions' angles (rotate-half layout); with
    partial rotary only the first 2 * cos.shape[-1] dimensions turn, the rest pass through."""
    cos, sin = angles
    rotary_dim = 2 * cos.shape[-1]
    x32 = x.float()
    x1, x2 = x32[..., : rotary_dim // 2], x32[..., rotary_dim // 2 : rotary_dim]
    turned = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if rotary_dim == x.shape[-1]:
        return torch.cat(turned, dim=-1).to(x.dtype)
    return torch.cat((*turned, x32[..., rotary_dim:]), dim=-1).to(x.dtype)
