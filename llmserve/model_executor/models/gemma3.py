"""Gemma 3 (text) over a paged KV cache.

embed × sqrt(hidden) → N × (norm → attention with per-head q/k norms → norm → residual → norm → GeGLU
→ norm → residual) → norm → logits, soft-capped where the config says; in the arrangement of
`layers/decoder_layer.py`, with every part it has. Every norm multiplies by (1 + w), the checkpoint
holding w. Most layers attend within a sliding window and rotate with a local RoPE base; the others
(one in six in every Gemma 3) see the whole sequence and rotate with the global base and the config's
rope scaling.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmserve.model_executor.layers.decoder_layer import DecoderLayer, LayerParts, LayerShape
from llmserve.model_executor.layers.layernorm import RMSNorm
from llmserve.model_executor.layers.mlp import GatedMLP
from llmserve.model_executor.layers.rotary_embedding import RotaryEmbedding
from llmserve.model_executor.models.causal_lm import CausalLM
from llmserve.model_executor.models.decoder_config import DecoderConfig, gguf_fields
from llmserve.model_executor.models.llama import LLAMA_FUSED_SHARDS, LlamaAttention

if TYPE_CHECKING:
    from llmserve.model_executor.loader.gguf_file import GGUFHeader

SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma3TextConfig's defaults where DecoderConfig.from_hf_dict would assume another value.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "tie_word_embeddings": True,
    "sliding_window": 4096,
}
# llama.cpp's tensor names inside a Gemma 3 layer → Hugging Face's.
GEMMA3_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class Gemma3Config(DecoderConfig):
    """`rope_theta` and `rope_scaling` are the full-attention layers'; `layer_types` is always set."""

    query_pre_attn_scalar: float = 256.0  # the attention scores are scaled by its -1/2 power
    rope_local_base_freq: float = 10_000.0  # the RoPE base of the sliding-window layers
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # Gemma 2's; Gemma 3 has none, and we refuse one
    hidden_activation: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None or not set(self.layer_types) <= {SLIDING, FULL}:
            raise ValueError(f"layer_types must name each layer {SLIDING} or {FULL}, got {self.layer_types}.")
        if self.query_pre_attn_scalar <= 0:
            raise ValueError(f"query_pre_attn_scalar must be positive, got {self.query_pre_attn_scalar}.")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise ValueError(f"final_logit_softcapping must be positive, got {self.final_logit_softcapping}.")
        if self.attn_logit_softcapping is not None:
            raise ValueError("attn_logit_softcapping is not supported (Gemma 3 checkpoints do not set it).")
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation must be gelu_pytorch_tanh, got {self.hidden_activation!r}.")

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` is a local one: the local RoPE base, and the window where there is one."""
        assert self.layer_types is not None
        return self.layer_types[layer] == SLIDING

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> Gemma3Config:
        """From a Gemma 3 text config.json, as transformers 5 writes it (`rope_parameters` per layer
        type) or as older versions did (`rope_theta`, `rope_local_base_freq`, `rope_scaling`)."""
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention (EmbeddingGemma) is not supported.")
        cfg = {**_HF_DEFAULTS, **cfg}
        if not cfg.get("layer_types"):
            pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
            layers = range(int(cfg["num_hidden_layers"]))
            cfg["layer_types"] = [SLIDING if (i + 1) % pattern else FULL for i in layers]
        rope = cfg.get("rope_parameters") or {}
        full = rope.get(FULL, rope) or {}
        local = rope.get(SLIDING) or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.{SLIDING}: only default RoPE is supported, got {local}.")
        scaling = cfg.get("rope_scaling")
        if scaling is None and full.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in full.items() if k != "rope_theta"}
        base = super().from_hf_dict(cfg)
        assert isinstance(base, Gemma3Config)
        cap = cfg.get("final_logit_softcapping")
        attn_cap = cfg.get("attn_logit_softcapping")
        return dataclasses.replace(
            base,
            rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
            rope_scaling=scaling,
            rope_local_base_freq=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=float(cap) if cap is not None else None,
            attn_logit_softcapping=float(attn_cap) if attn_cap is not None else None,
            hidden_activation=str(cfg.get("hidden_activation", "gelu_pytorch_tanh")),
        )

    @classmethod
    def from_gguf(cls, header: GGUFHeader, architecture: str) -> Gemma3Config:
        """From llama.cpp's metadata, reading what it leaves out as llama.cpp does (src/models/gemma3.cpp):
        without a sliding window every layer is global; the pattern defaults to 6 (every sixth layer
        global), the local RoPE base to 10000, and the score scale to 1/sqrt(head_dim), except in the
        62-layer 27B, whose query_pre_attn_scalar is hidden / heads."""
        fields = gguf_fields(header, architecture)
        meta, arch = header.metadata, header.architecture
        layers = int(fields["num_hidden_layers"])
        if fields["sliding_window"] is None:
            sliding = [False] * layers
        else:
            sliding = _gguf_sliding_layers(meta.get(f"{arch}.attention.sliding_window_pattern", 6), layers)
        scalar = fields["hidden_size"] / fields["num_attention_heads"] if layers == 62 else fields["head_dim"]
        cap = meta.get(f"{arch}.final_logit_softcapping")
        attn_cap = meta.get(f"{arch}.attn_logit_softcapping")
        return cls(
            **fields,
            layer_types=tuple(SLIDING if s else FULL for s in sliding),
            query_pre_attn_scalar=float(scalar),
            rope_local_base_freq=float(meta.get(f"{arch}.rope.freq_base_swa", 10_000.0)),
            final_logit_softcapping=float(cap) if cap else None,
            attn_logit_softcapping=float(attn_cap) if attn_cap else None,
        )


def _gguf_sliding_layers(pattern: int | list[bool], layers: int) -> list[bool]:
    """llama.cpp's `sliding_window_pattern`: one flag per layer, or n where every n-th layer is global
    (0: none is)."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(
                f"attention.sliding_window_pattern names {len(pattern)} layers; the model has {layers}."
            )
        return [bool(p) for p in pattern]
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(layers)]


def _norm(size: int, config: DecoderConfig) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, offset=1.0)


class Gemma3Attention(LlamaAttention):
    def __init__(self, config: Gemma3Config, stored: bool) -> None:
        super().__init__(config, stored)
        self.q_norm = _norm(config.head_dim, config)
        self.k_norm = _norm(config.head_dim, config)


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, config: Gemma3Config, stored: bool, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = _norm(config.hidden_size, config)
        self.self_attn = Gemma3Attention(config, stored)
        self.post_attention_layernorm = _norm(config.hidden_size, config)
        self.pre_feedforward_layernorm = _norm(config.hidden_size, config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, "gelu_tanh", stored)
        self.post_feedforward_layernorm = _norm(config.hidden_size, config)
        self.parts = LayerParts(
            input_norm=self.input_layernorm,
            qkv=self.self_attn.qkv_proj,
            o=self.self_attn.o_proj,
            mlp_norm=self.pre_feedforward_layernorm,
            mlp=self.mlp,
            rotary=rotary,
            q_norm=self.self_attn.q_norm,
            k_norm=self.self_attn.k_norm,
            attn_out_norm=self.post_attention_layernorm,
            mlp_out_norm=self.post_feedforward_layernorm,
        )
        self.shape = LayerShape.of(config, layer, scale=config.query_pre_attn_scalar**-0.5)


class Gemma3ForCausalLM(CausalLM):
    config_class = Gemma3Config
    fused_shards = LLAMA_FUSED_SHARDS
    gguf_layer_names = GEMMA3_GGUF_LAYER_NAMES
    config: Gemma3Config

    def __init__(self, config: DecoderConfig, stored: bool = False) -> None:
        if not isinstance(config, Gemma3Config):
            raise ValueError(f"Gemma3ForCausalLM needs a Gemma3Config, got {type(config).__name__}.")
        super().__init__(config, stored)
        c, positions = config, config.max_position_embeddings
        self.rotary_local = RotaryEmbedding(c.head_dim, positions, c.rope_local_base_freq, None)
        self.rotary_global = RotaryEmbedding(c.head_dim, positions, c.rope_theta, c.rope_scaling)
        self.layers = nn.ModuleList(
            [
                Gemma3DecoderLayer(c, stored, i, self.rotary_local if c.is_sliding(i) else self.rotary_global)
                for i in range(c.num_hidden_layers)
            ]
        )
        self.norm = _norm(c.hidden_size, c)

    @classmethod
    def gguf_tensor(cls, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """llama.cpp's converter stores every Gemma norm as 1 + w; our norms hold w, as HF's checkpoint."""
        return tensor - 1.0 if hf_name.endswith("norm.weight") else tensor

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * _embed_scale(self.config.hidden_size, x.dtype)

    def compute_logits(self, hidden: torch.Tensor, reuse: bool = False) -> torch.Tensor:
        logits = super().compute_logits(hidden, reuse)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


@functools.cache
def _embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to the embedding's dtype first, as Hugging Face's Gemma rounds it."""
    return float(torch.tensor(hidden_size**0.5, dtype=dtype))
