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
from typing import TYPE_CHECKING, Any, cast

from llmserve.model_executor.layers.rotary_embedding import RotaryEmbedding
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    llama_mlp,
)

if TYPE_CHECKING:
    from llmserve.model_executor.loader.gguf_file import GGUFHeader


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


class Phi3ForCausalLM(LlamaForCausalLM):
    config_class = Phi3Config
    fused_shards = {}  # the checkpoint's qkv_proj and gate_up_proj are ours as they are

    def make_rotary(self, config: DecoderConfig) -> RotaryEmbedding:
        assert isinstance(config, Phi3Config)
        return RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            rotary_dim=config.rotary_dim,
        )

    def make_layer(self, config: DecoderConfig, stored: bool, layer: int) -> LlamaDecoderLayer:
        attention, mlp = LlamaAttention(config, stored, shards=1), llama_mlp(config, stored, shards=1)
        return LlamaDecoderLayer(config, layer, self.rotary, attention, mlp)
