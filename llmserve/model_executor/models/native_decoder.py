"""Decode steps through `kernels/decoder_step.c`: every layer in one C call, built from the layers' parts.

Taken where the execution plan says so (stored weights: the CPU in fp32 with our kernels) and the step
holds decodes only. At a few rows the projections are ~half the step and the ~1,500 PyTorch calls of
the layers were the other half; at 64 rows those calls, with their tensors larger than the caches, took
~15% of it. Steps with a prefill keep the PyTorch path. Both compute the `DecoderLayer` of
`layers/decoder_layer.py` from the same `LayerParts`: the spec below holds the addresses of those very
modules' weights, so an architecture is described once and either path runs it.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from llmserve.model_executor.attention import AttentionMetadata
from llmserve.model_executor.execution_plan import ExecutionPlan
from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.decoder_layer import DecoderLayer, KVCache
from llmserve.model_executor.layers.layernorm import RMSNorm
from llmserve.model_executor.layers.linear import Linear, StoredKernel

if TYPE_CHECKING:
    from llmserve.model_executor.models.causal_lm import CausalLM


def _weight(linear: Linear) -> native.Weight:
    assert isinstance(linear.kernel, StoredKernel)
    return linear.kernel.weight.native


class NativeDecoder:
    def __init__(self, model: CausalLM, plan: ExecutionPlan) -> None:
        why = misfit(model)
        if why is not None:  # the runner asks misfit() first and plans op-by-op decodes instead
            raise ValueError(f"{why}: plan.without_fused_decode() before building a NativeDecoder.")
        layers = model.decoder_layers()
        norm = next(m for m in model.modules() if isinstance(m, RMSNorm))
        shape = layers[0].shape
        self.model = model  # keeps the tensors behind the spec's addresses alive
        self.layers = (native.LayerSpec * len(layers))()
        for spec, layer in zip(self.layers, layers):
            _describe(spec, layer)
        self.spec = native.DecoderSpec(
            num_layers=len(layers),
            hidden=model.config.hidden_size,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            intermediate=shape.intermediate_size,
            int8_activations=plan.int8_activations,
            block_rows=plan.block_rows,
            activation=native.ACTIVATIONS[shape.activation],
            eps=norm.eps,
            scale=shape.scale,
            norm_offset=norm.offset,
            layers=ctypes.cast(self.layers, ctypes.POINTER(native.LayerSpec)),
            final_norm=_address(model.norm),
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
        for spec, layer, (k_cache, v_cache) in zip(self.layers, self.model.decoder_layers(), kv_caches):
            spec.k_cache, spec.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            # the tables are built with the cache, for its max_model_len (ModelRunner.initialize_kv_cache)
            rotary = layer.parts.rotary
            spec.rope_cos, spec.rope_sin = rotary.cos.data_ptr(), rotary.sin.data_ptr()
            self.spec.rope_positions = rotary.cos.shape[0]  # the same for every table
        _, self.spec.num_blocks, self.spec.block_size, _ = kv_caches[0][0].shape
        self.spec.kv_bf16 = kv_caches[0][0].dtype == torch.bfloat16  # else fp32 (`--kv-cache-dtype`)
        self.kv_caches = kv_caches


def misfit(model: CausalLM) -> str | None:
    """Why decoder_step.c cannot run this model's layers (what it takes for granted), or None."""
    name, layers = type(model).__name__, model.decoder_layers()
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    if len({(norm.offset, norm.eps) for norm in norms}) != 1:
        return f"decoder_step.c takes one norm offset and eps per model; {name} has several"
    shapes = {dataclasses.replace(layer.shape, sliding_window=None) for layer in layers}
    if len(shapes) != 1:
        return f"decoder_step.c takes layers of one shape; {name} has {len(shapes)}"
    for layer in layers:
        p = layer.parts
        if (p.q_norm is None) != (p.k_norm is None):
            return f"decoder_step.c takes both q and k norms or neither; {name} has one"
        if p.rotary.rotary_dim != layer.shape.head_dim:
            return f"decoder_step.c rotates whole heads; {name} rotates part of each"
    return None


def _describe(spec: native.LayerSpec, layer: DecoderLayer) -> None:
    """Point `spec` at the layer's parts."""
    p = layer.parts
    spec.input_norm, spec.post_norm = _address(p.input_norm), _address(p.mlp_norm)
    spec.q_norm, spec.k_norm = _address(p.q_norm), _address(p.k_norm)
    spec.attn_out_norm, spec.mlp_out_norm = _address(p.attn_out_norm), _address(p.mlp_out_norm)
    spec.qkv, spec.o, spec.gate_up, spec.down = (_weight(m) for m in (p.qkv, p.o, p.gate_up, p.down))
    spec.sliding_window = layer.shape.sliding_window or 0


def _address(norm: nn.Module | None) -> int | None:
    """An RMSNorm's weight, fp32 and contiguous as the C code reads it; None (NULL) for a missing norm."""
    if norm is None:
        return None
    assert isinstance(norm, RMSNorm) and norm.weight.dtype == torch.float32 and norm.weight.is_contiguous()
    return norm.weight.data_ptr()
