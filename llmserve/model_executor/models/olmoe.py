"""OLMoE (OLMoE-1B-7B): the Llama layer with experts, and RMSNorms over the whole query and key
projections (not per head, unlike Qwen3's), before they are split into heads.

A softmax over the router's logits and the top k, not renormalised unless `norm_topk_prob` says so.
"""

from __future__ import annotations

from llmserve.model_executor.layers.layernorm import RMSNorm
from llmserve.model_executor.layers.mlp import MLP
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from llmserve.model_executor.models.mixtral import moe_mlp
from llmserve.model_executor.models.moe_config import MoEConfig
from llmserve.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM


class OlmoeAttention(LlamaAttention):
    def __init__(self, config: DecoderConfig, stored: bool) -> None:
        super().__init__(config, stored)
        self.q_norm = RMSNorm(config.num_attention_heads * config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.num_key_value_heads * config.head_dim, config.rms_norm_eps)


class OlmoeForCausalLM(LlamaForCausalLM):
    config_class = MoEConfig
    gguf_layer_names = Qwen3MoeForCausalLM.gguf_layer_names  # the same tensors, the norms' widths aside

    def make_layer(self, config: DecoderConfig, stored: bool, layer: int) -> LlamaDecoderLayer:
        attention, mlp = OlmoeAttention(config, stored), self.make_mlp(config, stored, layer)
        decoder_layer = LlamaDecoderLayer(config, layer, self.rotary, attention, mlp)
        decoder_layer.parts.qk_norm_per_head = False
        return decoder_layer

    def make_mlp(self, config: DecoderConfig, stored: bool, layer: int) -> MLP:
        return moe_mlp(config, stored, layer)
