"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Reads like the architecture: embed → N × (RMSNorm → attention → residual → RMSNorm → SwiGLU → residual)
→ RMSNorm → logits. Q, K and V share one projection, as do the MLP's gate and up. Mistral's sliding
window, where its config has one, limits what each layer attends to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model_executor.attention import AttentionMetadata, paged_attention
from llmserve.model_executor.execution_plan import ExecutionPlan
from llmserve.model_executor.layers.layernorm import RMSNorm
from llmserve.model_executor.layers.linear import Linear
from llmserve.model_executor.layers.rotary_embedding import RopeAngles, RotaryEmbedding, apply_rope
from llmserve.model_executor.models.causal_lm import CausalLM, KVCache
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.native_decoder import NativeDecoder

# Checkpoint name fragment → (our fused parameter fragment, shard index among its parts).
LLAMA_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: DecoderConfig, stored: bool, layer: int) -> None:
        super().__init__()
        self.sliding_window = config.layer_window(layer)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        width = self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(config.hidden_size, width, config.attention_bias, stored, shards=3)
        self.o_proj = Linear(self.q_size, config.hidden_size, False, stored)
        self.scale = self.head_dim**-0.5

    def forward(
        self, rope: RopeAngles, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(-1, self.num_heads, self.head_dim), rope)
        k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), rope)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: DecoderConfig, stored: bool) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, stored, shards=2)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, stored)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, stored: bool, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, stored, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, stored)

    def forward(
        self, rope: RopeAngles, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    fused_shards = LLAMA_FUSED_SHARDS
    fused_decode_layer = True

    def __init__(self, config: DecoderConfig, stored: bool = False) -> None:
        super().__init__(config, stored)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, stored, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.native_decoder: NativeDecoder | None = None  # decode steps in C, when the plan says so

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] after the final norm."""
        x = self.embed_tokens(input_ids)
        if self.native_decoder is not None and self.native_decoder.accepts(meta):
            return self.native_decoder(x, positions, kv_caches, meta)
        rope = self.rotary(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(rope, x, kv_cache, meta)
        return self.norm(x)

    def prepare_kernels(self, plan: ExecutionPlan) -> None:
        super().prepare_kernels(plan)
        self.native_decoder = NativeDecoder(self, plan) if plan.fused_decode else None
