"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norms) with experts.

A softmax over the router's logits, the top k, renormalised where `norm_topk_prob` says (llama.cpp always
renormalises a `qwen3moe` GGUF's). Layers named in `mlp_only_layers`, or off the `decoder_sparse_step`,
have Qwen3's dense MLP.
"""

from __future__ import annotations

from llmserve.model_executor.layers.mlp import MLP
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.mixtral import MOE_GGUF_LAYER_NAMES, moe_mlp
from llmserve.model_executor.models.moe_config import MoEConfig
from llmserve.model_executor.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    config_class = MoEConfig
    gguf_layer_names = {**Qwen3ForCausalLM.gguf_layer_names, **MOE_GGUF_LAYER_NAMES}

    def make_mlp(self, config: DecoderConfig, stored: bool, layer: int) -> MLP:
        return moe_mlp(config, stored, layer)
