"""Qwen3 (dense): the Llama layer with an RMSNorm over each head's queries and keys before RoPE.

embed → N × (RMSNorm → QKV → q/k RMSNorm per head → RoPE → attention → residual → RMSNorm → SwiGLU →
residual) → RMSNorm → logits. No QKV bias (unlike Qwen2), and `head_dim` comes from the config, not
hidden / heads. The config's sliding window counts only with `use_sliding_window`.
"""

from __future__ import annotations

from llmserve.model_executor.layers.layernorm import RMSNorm
from llmserve.model_executor.models.causal_lm import LLAMA_GGUF_LAYER_NAMES
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)


class Qwen3Attention(LlamaAttention):
    """Llama's projections, plus the norms over each head's head_dim (`q_norm`, `k_norm`)."""

    def __init__(self, config: DecoderConfig, stored: bool) -> None:
        super().__init__(config, stored)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)


class Qwen3ForCausalLM(LlamaForCausalLM):
    gguf_layer_names = {
        **LLAMA_GGUF_LAYER_NAMES,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }

    def make_layer(self, config: DecoderConfig, stored: bool, layer: int) -> LlamaDecoderLayer:
        attention = Qwen3Attention(config, stored)
        return LlamaDecoderLayer(config, layer, self.rotary, attention, self.make_mlp(config, stored, layer))
