"""Decode steps of a Llama through `kernels/decoder_step.c`: every layer in one C call.

Taken when the model runs on the CPU in fp32 with our kernels for every projection (`PackedKernel`, or a
`BlockKernel` over GGUF blocks with a `PackedKernel` for the larger batches: a Q4_1/Q8_0 GGUF, or
`--quantization int8|int4`) and the step holds decodes only. At a few rows the projections are ~half
the step and the ~1,500 PyTorch calls of the layers were the other half; at 64 rows those calls, with
their tensors larger than the caches, took ~15% of it. Steps with a prefill keep the PyTorch path,
which computes the same thing with the same kernels.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, cast

import torch

from llmserve.model_executor.attention import AttentionMetadata
from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.linear import BLOCK_ROWS, BlockKernel, Linear, PackedKernel

if TYPE_CHECKING:
    from llmserve.model_executor.models.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM


def _kernels(model: LlamaForCausalLM) -> list[object]:
    return [m.kernel for m in model.modules() if isinstance(m, Linear)]


def _packed(kernel: object) -> PackedKernel | None:
    """The packed fp32 kernel a projection's kernel is or falls back to."""
    large = kernel.large if isinstance(kernel, BlockKernel) else kernel
    return large if isinstance(large, PackedKernel) else None


def _projection(linear: Linear) -> native.Projection:
    kernel, packed = linear.kernel, _packed(linear.kernel)
    assert packed is not None
    bias = 0 if packed.bias is None else packed.bias.data_ptr()
    if isinstance(kernel, BlockKernel):
        return native.Projection(kernel.blocks.data_ptr(), packed.packed.data_ptr(), bias, kernel.qtype)
    return native.Projection(0, packed.packed.data_ptr(), bias, 0)


class NativeDecoder:
    def __init__(self, model: LlamaForCausalLM) -> None:
        c = model.config
        self.model = model  # keeps the tensors behind the spec's addresses alive
        self.layers = (native.LayerSpec * c.num_hidden_layers)()
        for spec, module in zip(self.layers, model.layers):
            layer = cast("LlamaDecoderLayer", module)
            spec.input_norm = layer.input_layernorm.weight.data_ptr()
            spec.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            spec.qkv = _projection(layer.self_attn.qkv_proj)
            spec.o = _projection(layer.self_attn.o_proj)
            spec.gate_up = _projection(layer.mlp.gate_up_proj)
            spec.down = _projection(layer.mlp.down_proj)
        self.spec = native.DecoderSpec(
            num_layers=c.num_hidden_layers,
            hidden=c.hidden_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            intermediate=c.intermediate_size,
            int8_activations=any(k.int8_activations for k in _kernels(model) if isinstance(k, BlockKernel)),
            block_rows=BLOCK_ROWS,
            eps=c.rms_norm_eps,
            scale=c.head_dim**-0.5,
            layers=ctypes.cast(self.layers, ctypes.POINTER(native.LayerSpec)),
            rope_cos=model.rotary.cos.data_ptr(),
            rope_sin=model.rotary.sin.data_ptr(),
            final_norm=model.norm.weight.data_ptr(),
        )
        self.kv_caches: list[KVCache] | None = None

    @staticmethod
    def applies_to(model: LlamaForCausalLM) -> bool:
        """Every projection has packed fp32 weights, and either all read blocks, with the same
        activations, or none does; the weights are fp32 on the CPU and the library loaded."""
        kernels = _kernels(model)
        blocks = [k for k in kernels if isinstance(k, BlockKernel)]
        return (
            len(kernels) > 0
            and all(_packed(k) is not None for k in kernels)
            and len(blocks) in (0, len(kernels))
            and len({k.int8_activations for k in blocks}) <= 1
            and model.norm.weight.dtype == torch.float32
            and native.load_library() is not None
        )

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
