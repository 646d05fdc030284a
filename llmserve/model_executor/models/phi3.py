"""Phi-3 (and Phi-4-mini, which shares its architecture): the Llama layer over the checkpoint's fused
projections, with LongRoPE where the config scales its rotary embedding.

embed → N × (RMSNorm → qkv_proj → RoPE → attention → residual → RMSNorm → gate_up_proj → SiLU(gate) * up
→ down_proj → residual) → RMSNorm → logits. The checkpoint stores Q, K and V as one tensor and gate and
up as another, so each projection holds one part where Llama's gather shards. LongRoPE ("su" in older
configs) and partial rotary live in `layers/rotary_embedding.py`; a sliding window, where the config has
one (Phi-3-mini-4k's 2047), limits what each layer attends to.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from llmserve.model_executor.layers.decoder_layer import DecoderLayer, LayerParts
from llmserve.model_executor.layers.layernorm import RMSNorm
from llmserve.model_executor.layers.linear import Linear
from llmserve.model_executor.layers.rotary_embedding import RotaryEmbedding
from llmserve.model_executor.loader.gguf_file import GGUFHeader
from llmserve.model_executor.models.causal_lm import CausalLM
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.llama import llama_shape


@dataclass(frozen=True)
class Phi3Config(DecoderConfig):
    partial_rotary_factor: float = 1.0  # the share of each head RoPE turns (Phi-4-mini: 0.75)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> Phi3Config:
        """Older configs keep `original_max_position_embeddings` and `partial_rotary_factor` beside
        `rope_scaling`; transformers >= 5 moves both into `rope_parameters`."""
        config = cast(Phi3Config, super().from_hf_dict(cfg))  # `super()` builds a `cls`
        rope = cfg.get("rope_parameters") or {}
        scaling = config.rope_scaling
        # transformers reads the top-level value first, then rope_parameters', then 4096
        original = cfg.get("original_max_position_embeddings") or (scaling or {}).get(
            "original_max_position_embeddings", 4096
        )
        if scaling is not None:
            scaling = {**scaling, "original_max_position_embeddings": int(original)}
        factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}.")
        return dataclasses.replace(config, rope_scaling=scaling, partial_rotary_factor=factor)

    @classmethod
    def from_gguf(cls, header: GGUFHeader, architecture: str) -> Phi3Config:
        """Refused: llama.cpp's converter stores LongRoPE's factors as tensors (rope_factors_long,
        rope_factors_short), which the GGUF loader does not read, and no test covers its Phi-3 files."""
        raise ValueError(f"{header.path}: Phi-3 GGUF files are not supported; use the Hugging Face folder.")


class Phi3Attention(nn.Module):
    def __init__(self, config: DecoderConfig, stored: bool) -> None:
        super().__init__()
        q_size = config.num_attention_heads * config.head_dim
        width = q_size + 2 * config.num_key_value_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, width, False, stored)  # one checkpoint tensor: q|k|v
        self.o_proj = Linear(q_size, config.hidden_size, False, stored)


class Phi3MLP(nn.Module):
    def __init__(self, config: DecoderConfig, stored: bool) -> None:
        super().__init__()
        # one checkpoint tensor: gate | up
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, stored)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, stored)


class Phi3DecoderLayer(DecoderLayer):
    def __init__(self, config: DecoderConfig, stored: bool, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Phi3Attention(config, stored)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Phi3MLP(config, stored)
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


class Phi3ForCausalLM(CausalLM):
    config_class = Phi3Config

    @classmethod
    def fused_decode_layer(cls, config: DecoderConfig) -> bool:
        """decoder_step.c rotates whole heads; Phi-4-mini rotates 3/4 of each, so it decodes op by op."""
        return isinstance(config, Phi3Config) and config.rotary_dim == config.head_dim

    def __init__(self, config: DecoderConfig, stored: bool = False) -> None:
        super().__init__(config, stored)
        assert isinstance(config, Phi3Config)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            rotary_dim=config.rotary_dim,
        )
        self.layers = nn.ModuleList(
            [Phi3DecoderLayer(config, stored, i, self.rotary) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
