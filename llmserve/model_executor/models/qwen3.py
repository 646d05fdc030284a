"""Qwen3 (dense): the Llama layer with an RMSNorm over each head's queries and keys before RoPE.

embed → N × (RMSNorm → QKV → q/k RMSNorm per head → RoPE → attention → residual → RMSNorm → SwiGLU →
residual) → RMSNorm → logits. No QKV bias (unlike Qwen2), and `head_dim` comes from the config, not
hidden / heads. The config's sliding window counts only with `use_sliding_window`.
"""

from __future__ import annotations

from torch import nn

from llmserve.model_executor.layers.decoder_layer import DecoderLayer, LayerParts
from llmserve.model_executor.layers.layernorm import RMSNorm
from llmserve.model_executor.layers.rotary_embedding import RotaryEmbedding
from llmserve.model_executor.models.causal_lm import LLAMA_GGUF_LAYER_NAMES, CausalLM
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.llama import LLAMA_FUSED_SHARDS, LlamaAttention, LlamaMLP, llama_shape


class Qwen3Attention(LlamaAttention):
    """Llama's projections, plus the norms over each head's head_dim (`q_norm`, `k_norm`)."""

    def __init__(self, config: DecoderConfig, stored: bool) -> None:
        super().__init__(config, stored)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, config: DecoderConfig, stored: bool, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, stored)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, stored)
        self.parts = LayerParts(
            input_norm=self.input_layernorm,
            qkv=self.self_attn.qkv_proj,
            o=self.self_attn.o_proj,
            mlp_norm=self.post_attention_layernorm,
            gate_up=self.mlp.gate_up_proj,
            down=self.mlp.down_proj,
            rotary=rotary,
            q_norm=self.self_attn.q_norm,
            k_norm=self.self_attn.k_norm,
        )
        self.shape = llama_shape(config, layer)


class Qwen3ForCausalLM(CausalLM):
    fused_shards = LLAMA_FUSED_SHARDS
    gguf_layer_names = {
        **LLAMA_GGUF_LAYER_NAMES,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }

    def __init__(self, config: DecoderConfig, stored: bool = False) -> None:
        super().__init__(config, stored)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            [Qwen3DecoderLayer(config, stored, i, self.rotary) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
