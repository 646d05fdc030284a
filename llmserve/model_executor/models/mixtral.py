"""Mixtral: the Llama layer with a Mixture-of-Experts MLP (`layers/moe.py`), and what every MoE family
here shares: the experts' block, by layer (Qwen's dense layers take Llama's MLP), and llama.cpp's names.

A softmax over the router's logits, the top k, renormalised (always: the softmax of the top k logits).
The checkpoint calls the block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up) and w2
(down); llama.cpp stores Mixtral as a `llama` GGUF that has experts.
"""

from __future__ import annotations

from llmserve.model_executor.layers.mlp import MLP
from llmserve.model_executor.layers.moe import SparseMoE
from llmserve.model_executor.models.causal_lm import LLAMA_GGUF_LAYER_NAMES
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.llama import (
    LlamaForCausalLM,
    llama_mlp,
)
from llmserve.model_executor.models.moe_config import MoEConfig

# llama.cpp's names for an MoE layer's tensors → Hugging Face's; "{}" is the expert, whose slice of the
# 3-D tensor is its own weight.
MOE_GGUF_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}


def moe_mlp(config: DecoderConfig, stored: bool, layer: int) -> MLP:
    """Layer `layer`'s experts, or Llama's dense MLP where the config makes the layer dense."""
    assert isinstance(config, MoEConfig)
    if not config.is_sparse(layer):
        return llama_mlp(config, stored)
    return SparseMoE(
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts,
        config.num_experts_per_tok,
        config.norm_topk_prob,
        stored,
        config.shared_expert_intermediate_size,
    )


class MixtralForCausalLM(LlamaForCausalLM):
    config_class = MoEConfig
    checkpoint_renames = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    gguf_layer_names = {**LLAMA_GGUF_LAYER_NAMES, **MOE_GGUF_LAYER_NAMES}

    def make_mlp(self, config: DecoderConfig, stored: bool, layer: int) -> MLP:
        return moe_mlp(config, stored, layer)
