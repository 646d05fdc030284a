"""One pre-norm decoder layer, the arrangement every architecture in `models/` shares; each names its parts.

    x → input_norm → QKV → (q_norm, k_norm per head) → RoPE → paged attention (maybe windowed) → o
      → (attn_out_norm) → + x → mlp_norm → mlp → (mlp_out_norm) → + x

Llama, Mistral, Qwen2 and Phi-3 have no q/k or output norms and use SiLU; Qwen3 adds the q/k norms
(OLMoE's span the whole projections, before they are split into heads);
Gemma 3 has them all, with (1 + w) norms and tanh GELU. The MLP is a role (`layers/mlp.py`): dense
act(gate) * up → down, or a Mixture-of-Experts block (`layers/moe.py`). An architecture's
layer builds its parts under its checkpoint's names and hands them over as `LayerParts`: this forward
and the fused decode step (`native_decoder.py` → `kernels/decoder_step.c`) both compute from
those same parts, so a layer is defined once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from llmserve.model_executor.attention import AttentionMetadata, paged_attention
from llmserve.model_executor.layers.linear import Linear
from llmserve.model_executor.layers.mlp import MLP
from llmserve.model_executor.layers.rotary_embedding import RopeAngles, RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from llmserve.model_executor.execution_plan import ExecutionPlan
    from llmserve.model_executor.models.decoder_config import DecoderConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [kv_heads, num_blocks, block_size, head_dim]


@dataclass
class LayerParts:
    """The modules of one layer by role (registered on the layer under the checkpoint's names)."""

    input_norm: nn.Module
    qkv: Linear  # the queries' rows, then the keys', then the values'
    o: Linear
    mlp_norm: nn.Module
    mlp: MLP
    rotary: RotaryEmbedding  # shared between layers that use the same tables
    q_norm: nn.Module | None = None  # over each head's head_dim, before RoPE
    k_norm: nn.Module | None = None
    qk_norm_per_head: bool = True  # False: q_norm and k_norm span the whole projections (OLMoE)
    attn_out_norm: nn.Module | None = None  # on the attention's output, before the residual add
    mlp_out_norm: nn.Module | None = None


@dataclass(frozen=True)
class LayerShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # of the attention scores
    sliding_window: int | None

    @classmethod
    def of(cls, config: DecoderConfig, layer: int, scale: float | None = None) -> LayerShape:
        """Layer `layer` of a model of this config; `scale` defaults to head_dim ** -0.5."""
        return cls(
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            scale=config.head_dim**-0.5 if scale is None else scale,
            sliding_window=config.layer_window(layer),
        )


class DecoderLayer(nn.Module):
    """Subclasses build their modules, then set `parts` and `shape`; `prepare` takes the plan's kernels."""

    parts: LayerParts
    shape: LayerShape

    def prepare(self, plan: ExecutionPlan) -> None:
        """The kernels the plan gives the layer's own ops (its projections prepare themselves)."""
        self.parts.mlp.prepare(plan)

    def forward(
        self, rope: RopeAngles, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        p, s = self.parts, self.shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q, k, v = p.qkv(p.input_norm(x)).split([q_size, kv_size, kv_size], dim=-1)
        if p.q_norm is not None and p.k_norm is not None and not p.qk_norm_per_head:
            q, k = p.q_norm(q), p.k_norm(k)
        q = q.reshape(-1, s.num_heads, s.head_dim)
        k = k.reshape(-1, s.num_kv_heads, s.head_dim)
        if p.q_norm is not None and p.k_norm is not None and p.qk_norm_per_head:
            q, k = p.q_norm(q), p.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        v = v.reshape(-1, s.num_kv_heads, s.head_dim)
        attended = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, s.scale, s.sliding_window)
        out = p.o(attended.reshape(-1, q_size))
        # In place on the new tensors a product or a norm returned: a prefill step's [tokens, width]
        # temporaries are megabytes each, and every one allocated is written and faulted in again.
        x = (out if p.attn_out_norm is None else p.attn_out_norm(out)).add_(x)
        out = p.mlp(p.mlp_norm(x))
        return (out if p.mlp_out_norm is None else p.mlp_out_norm(out)).add_(x)
