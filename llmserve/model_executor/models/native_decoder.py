"""Decode steps of a Llama through `kernels/decoder_step.c`: every layer in one C call.

Taken where the execution plan says so (a Llama-family layer, stored weights: the CPU in fp32 with our
kernels) and the step holds decodes only. At a few rows the projections are ~half the step and the
~1,500 PyTorch calls of the layers were the other half; at 64 rows those calls, with their tensors
larger than the caches, took ~15% of it. Steps with a prefill keep the PyTorch path, which computes
the same thing with the same kernels.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, cast

import torch

from llmserve.model_executor.attention import AttentionMetadata
from llmserve.model_executor.execution_plan import ExecutionPlan
from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.linear import Linear, StoredKernel

if TYPE_CHECKING:
    from llmserve.model_executor.models.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM


def _weight(linear: Linear) -> native.Weight:
    assert isinstance(linear.kernel, StoredKernel)
    return linear.kernel.weight.native


class NativeDecoder:
    def __init__(self, model: LlamaForCausalLM, plan: ExecutionPlan) -> None:
        c = model.config
        self.model = model  # keeps the tensors behind the spec's addresses alive
        self.layers = (native.LayerSpec * c.num_hidden_layers)()
        for spec, module in zip(self.layers, model.layers):
            layer = cast("LlamaDecoderLayer", module)
            spec.input_norm = layer.input_layernorm.weight.data_ptr()
            spec.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            spec.qkv = _weight(layer.self_attn.qkv_proj)
            spec.o = _weight(layer.self_attn.o_proj)
            spec.gate_up = _weight(layer.mlp.gate_up_proj)
            spec.down = _weight(layer.mlp.down_proj)
        self.spec = native.DecoderSpec(
            num_layers=c.num_hidden_layers,
            hidden=c.hidden_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            intermediate=c.intermediate_size,
            int8_activations=plan.int8_activations,
            block_rows=plan.block_rows,
            eps=c.rms_norm_eps,
            scale=c.head_dim**-0.5,
            layers=ctypes.cast(self.layers, ctypes.POINTER(native.LayerSpec)),
            rope_cos=model.rotary.cos.data_ptr(),
            rope_sin=model.rotary.sin.data_ptr(),
            final_norm=model.norm.weight.data_ptr(),
        )
        self.kv_caches: list[KVCache] | None = None

    @staticmethod
    def accepts(meta: AttentionMetadata) -> bool:
        return meta.native_decode and not meta.prefills and meta.num_decodes > 0

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """x: [rows, hidden] embedded tokens → hidden states after the final norm."""
        if kv_caches is not self.kv_caches:
            self._bind(kv_caches)
        return native.decoder_step(
            self.spec, x, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens
        )

    def _bind(self, kv_caches: list[KVCache]) -> None:
        for spec, (k_cache, v_cache) in zip(self.layers, kv_caches):
            spec.k_cache, spec.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        _, self.spec.num_blocks, self.spec.block_size, _ = kv_caches[0][0].shape
        self.kv_caches = kv_caches
