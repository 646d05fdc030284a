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
from llmserve.model_executor.layers.mlp import MLP, GatedMLP
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
    """QKV and output projections; `shards`: the checkpoint's tensors QKV is made of (q, k and v; Phi-3
    stores one)."""

    def __init__(self, config: DecoderConfig, stored: bool, shards: int = 3) -> None:
        super().__init__()
        q_size = config.num_attention_heads * config.head_dim
        width = q_size + 2 * config.num_key_value_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, width, config.attention_bias, stored, shards=shards)
        self.o_proj = Linear(q_size, config.hidden_size, False, stored)
        self.q_norm: nn.Module | None = None  # Qwen3's and Gemma's norms over each head
        self.k_norm: nn.Module | None = None


def llama_mlp(config: DecoderConfig, stored: bool, shards: int = 2) -> GatedMLP:
    """SwiGLU; `shards`: the checkpoint's tensors gate-up is made of."""
    return GatedMLP(config.hidden_size, config.intermediate_size, "silu", stored, shards)


class LlamaDecoderLayer(DecoderLayer):
    """Llama's modules under their checkpoint names, around another architecture's attention or MLP
    where it differs (Qwen3's q/k norms, Phi-3's single-tensor projections)."""

    def __init__(
        self, config: DecoderConfig, layer: int, rotary: RotaryEmbedding, self_attn: LlamaAttention, mlp: MLP
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.parts = LayerParts(
            input_norm=self.input_layernorm,
            qkv=self_attn.qkv_proj,
            o=self_attn.o_proj,
            mlp_norm=self.post_attention_layernorm,
            mlp=mlp,
            rotary=rotary,
            q_norm=self_attn.q_norm,
            k_norm=self_attn.k_norm,
        )
        self.shape = LayerShape.of(config, layer)


class LlamaForCausalLM(CausalLM):
    fused_shards = LLAMA_FUSED_SHARDS

    def __init__(self, config: DecoderConfig, stored: bool = False) -> None:
        super().__init__(config, stored)
        self.rotary = self.make_rotary(config)
        self.layers = nn.ModuleList(
            [self.make_layer(config, stored, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_rotary(self, config: DecoderConfig) -> RotaryEmbedding:
        return RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def make_layer(self, config: DecoderConfig, stored: bool, layer: int) -> LlamaDecoderLayer:
        """Layer `layer`; an architecture that differs from Llama inside its attention overrides this."""
        attention = LlamaAttention(config, stored)
        return LlamaDecoderLayer(config, layer, self.rotary, attention, self.make_mlp(config, stored, layer))

    def make_mlp(self, config: DecoderConfig, stored: bool, layer: int) -> MLP:
        """Layer `layer`'s MLP: SwiGLU; a Mixture-of-Experts architecture overrides this."""
        return llama_mlp(config, stored)
