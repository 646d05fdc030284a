"""Small decode steps of a Llama through `kernels/decoder_step.c`: every layer in one C call.

Taken when the model runs on the CPU in fp32 with every projection read from GGUF blocks (a Q4_1/Q8_0
GGUF, or `--quantization int8|int4`) and the step is up to `BLOCK_ROWS` decodes and nothing else: then
the projections are ~half the step and the ~1,500 PyTorch calls of the layers were the other half.
Larger or mixed steps keep the PyTorch path, which computes the same thing.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, cast

import torch

from llmserve.model_executor.attention import AttentionMetadata
from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.linear import BLOCK_ROWS, BlockKernel, Linear

if TYPE_CHECKING:
    from llmserve.model_executor.models.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM


def _block_kernels(model: LlamaForCausalLM) -> list[BlockKernel]:
    kernels = [m.kernel for m in model.modules() if isinstance(m, Linear)]
    return [k for k in kernels if isinstance(k, BlockKernel)]


def _projection(linear: Linear) -> native.Projection:
    kernel = linear.kernel
    assert isinstance(kernel, BlockKernel)
    bias = 0 if kernel.bias is None else kernel.bias.data_ptr()
    return native.Projection(kernel.blocks.data_ptr(), bias, kernel.qtype)


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
            int8_activations=_block_kernels(model)[0].int8_activations,
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
        """Every projection reads blocks, all with the same activations, the weights are fp32 on the CPU,
        and the library loaded."""
        kernels = _block_kernels(model)
        projections = sum(isinstance(m, Linear) for m in model.modules())
        return (
            len(kernels) == projections > 0
            and len({k.int8_activations for k in kernels}) == 1
            and model.norm.weight.dtype == torch.float32
            and native.load_library() is not None
        )

    @staticmethod
    def accepts(meta: AttentionMetadata) -> bool:
        return meta.native_decode and not meta.prefills and 0 < meta.num_decodes <= BLOCK_ROWS

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
