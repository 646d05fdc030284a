"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

embed → N × (RMSNorm → attention → residual → RMSNorm → SwiGLU → residual) → RMSNorm → logits, in the
arrangement of `layers/decoder_layer.py`. Q, K and V share one projection, as do the MLP's gate and up;
Qwen2 adds a QKV bias, Mistral a sliding window where its config has one.
"""

from __future__ import annotations

from torch import nn

from llmserve.model_executor.layers.decoder_layer import DecoderLayer, LayerParts, LayerShape
from llmserve.model_executor.layers.layernorm import RMSNorm
from llmserve.model_executor.layers.linear import Linear
from llmserve.model_executor.layers.rotary_embedding import RotaryEmbedding
from llmserve.model_executor.models.causal_lm import CausalLM
from llmserve.model_executor.models.decoder_config import DecoderConfig

# Checkpoint name fragment → (our fused parameter fragment, shard index among its parts).
LLAMA_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: DecoderConfig, stored: bool) -> None:
        super().__init__()
        q_size = config.num_attention_heads * config.head_dim
        width = q_size + 2 * config.num_key_value_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, width, config.attention_bias, stored, shards=3)
        self.o_proj = Linear(q_size, config.hidden_size, False, stored)


class LlamaMLP(nn.Module):
    def __init__(self, config: DecoderConfig, stored: bool) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, stored, shards=2)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, stored)


def llama_shape(config: DecoderConfig, layer: int) -> LayerShape:
    return LayerShape(
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        scale=config.head_dim**-0.5,
        sliding_window=config.layer_window(layer),
        activation="silu",
    )


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, config: DecoderConfig, stored: bool, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, stored)
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
        )
        self.shape = llama_shape(config, layer)


class LlamaForCausalLM(CausalLM):
    fused_shards = LLAMA_FUSED_SHARDS

    def __init__(self, config: DecoderConfig, stored: bool = False) -> None:
        super().__init__(config, stored)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, stored, i, self.rotary) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
