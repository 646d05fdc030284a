"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (QKV bias) with experts, and a shared
expert every token goes through, scaled by sigmoid(x · shared_expert_gate), added to the routed ones.

A softmax over the router's logits and the top k, renormalised where `norm_topk_prob` says.
"""

from __future__ import annotations

import torch

from llmserve.model_executor.layers.mlp import MLP
from llmserve.model_executor.models.causal_lm import LLAMA_GGUF_LAYER_NAMES
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.llama import LlamaForCausalLM
from llmserve.model_executor.models.mixtral import MOE_GGUF_LAYER_NAMES, moe_mlp
from llmserve.model_executor.models.moe_config import MoEConfig


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    config_class = MoEConfig
    gguf_layer_names = {
        **LLAMA_GGUF_LAYER_NAMES,
        **MOE_GGUF_LAYER_NAMES,
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
    }

    @classmethod
    def gguf_tensor(cls, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """llama.cpp stores the shared expert's gate [1, hidden] as a vector."""
        return tensor.unsqueeze(0) if hf_name.endswith("shared_expert_gate.weight") else tensor

    def make_mlp(self, config: DecoderConfig, stored: bool, layer: int) -> MLP:
        return moe_mlp(config, stored, layer)
