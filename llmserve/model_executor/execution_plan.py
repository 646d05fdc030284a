"""Which kernel runs each part of the forward pass, decided once at load and printed at start-up.

Model code never asks "is the C library loaded, is the batch small, is this a block weight": it asks
the plan. The rules, each with the reason it exists:

- Projections keep the checkpoint's stored weights (GGUF blocks, fp16/bf16) and go through our C
  kernels on the CPU in fp32 when the library built; elsewhere (GPUs, bf16 compute, no compiler) they
  hold a dense weight for PyTorch, through oneDNN's pre-packed path on the CPU in fp32 (and bf16, where
  the CPU has bf16 instructions).
- With int8 activations (`--quantization gguf|int8|int4`), a product of up to `block_rows` rows
  multiplies the blocks as integers (`block_q8.c`); more rows too where the CPU has AVX-512 VNNI
  (`int8_gemm.c`), else they round their activations the same way and take `weight_gemm.c`. Every
  batch size multiplies the same values.
- Decode attention reads the paged cache in place in C (`paged_attention.c`) on the CPU wherever the
  library built and the cache is fp32 or bf16 (widened exactly; it computes in fp32); else PyTorch
  gathers the blocks, which took 45% of a bf16 SmolLM2 run.
- Prefill attention reads the chunk's keys and values in place in C (`prefill_attention.c`) on the CPU
  wherever decode attention does: PyTorch's flash attention, one call per sequence, took 2.7x as long on
  SmolLM2's prompts of 32-512 tokens (a sixth of a 64-prompt run).
- Sampling's argmax (every greedy token) reads the logits with vectors in C (`argmax.c`) on the CPU
  wherever the library built: PyTorch's compares one value at a time, 12 ms a step for 64 rows of a
  262,144-token vocabulary. Same indices, ties and NaNs included.
- The MLP's act(gate) * up runs in C (`gated_activation.c`, the code decoder_step.c runs) wherever fp32
  decodes read the cache in C, so that prefill and decode round the activation alike; one pass over the
  rows, 2x PyTorch's silu and mul through a strided view on [512, 3072].
- A decode-only step runs every layer in one C call (`decoder_step.c`) when every projection keeps a
  stored weight and the built model's layers are ones that kernel computes (`native_decoder.misfit`:
  one norm, layers of one shape, q/k norms in pairs, whole-head RoPE); a model it cannot run decodes
  op by op, with the reason in the log, rather than failing the load. A layer whose MLP is of a kind
  the C lacks (`op_by_op_layers`) runs through PyTorch between the C calls over the layers around it.
  The model runner takes the plan's choice for each step; the model never asks.
- An encoder (BERT) multiplies whole prompts, hundreds of rows at once, and never decodes: its weights
  are dense, through oneDNN's pre-packed product on the CPU in fp32.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch

from llmserve.config import ModelConfig, Quantization
from llmserve.model_executor.kernels import native


def cpu_has_bf16_products() -> bool:
    """Whether oneDNN multiplies bf16 in bf16 instructions here (AVX512-BF16, AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class StoredProduct(enum.Enum):
    """How a projection with a stored weight multiplies a batch."""

    BLOCKS_AS_INTEGERS = "block_q8.c"
    INT8_GEMM = "int8_gemm.c"
    ROUNDED_THEN_WEIGHT_GEMM = "weight_gemm.c (int8-rounded activations)"
    WEIGHT_GEMM = "weight_gemm.c"


# The plan's other choices; each value is the kernel's name in the start-up log.
class DecodeAttentionKernel(enum.Enum):
    """What a decode step's queries attend to the paged cache with."""

    C = "paged_attention.c"  # in place
    TORCH = "torch"  # the blocks gathered first


class PrefillAttentionKernel(enum.Enum):
    """What a prefill chunk's queries attend to their keys with."""

    C = "prefill_attention.c"  # in place, from the paged cache
    TORCH_SDPA = "torch SDPA"


class ArgmaxKernel(enum.Enum):
    """What sampling's argmax (every greedy token) reads the logits with."""

    C = "argmax.c"
    TORCH = "torch"


class GatedActivationKernel(enum.Enum):
    """What computes the MLP's act(gate) * up outside decoder_step.c."""

    C = "gated_activation.c"
    TORCH = "torch"


class DenseProduct(enum.Enum):
    """What a dense weight multiplies with."""

    ONEDNN = "onednn"  # the weight pre-packed once
    TORCH = "torch"  # F.linear


@dataclass(frozen=True)
class ExecutionPlan:
    device: torch.device
    dtype: torch.dtype
    stored_weights: bool  # projections keep the checkpoint's format, for our C kernels
    quantization: Quantization
    int8_activations: bool
    block_rows: int  # with int8 activations, products of up to this many rows read the blocks
    int8_gemm: bool  # with int8 activations, larger products take int8_gemm.c (AVX-512 VNNI)
    decode_attention: DecodeAttentionKernel
    prefill_attention: PrefillAttentionKernel
    argmax: ArgmaxKernel
    gated_activation: GatedActivationKernel  # the MLP's act(gate) * up outside decoder_step.c
    fused_decode: bool  # decode-only steps through decoder_step.c
    reasons: tuple[str, ...]  # one line per decision that was not the fast path, for the log
    encoder: bool = False  # bidirectional, whole prompts: no KV cache, no decode
    op_by_op_layers: tuple[int, ...] = ()  # with fused_decode, the layers that still decode in PyTorch

    @classmethod
    def decide(
        cls,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        architecture: str,
        encoder: bool = False,
    ) -> ExecutionPlan:
        """`encoder`: the architecture is an encoder (dense weights, no decode). Whether decoder_step.c
        can run the built model's layers is asked once they exist (`without_fused_decode`)."""
        reasons: list[str] = []
        library = native.load_library() is not None if model_config.native_kernels else False
        if not model_config.native_kernels:
            reasons.append("C kernels off (native_kernels=False)")
        elif not library:
            reasons.append("C kernels unavailable (no compiler, or the build failed)")
        if device.type != "cpu":
            reasons.append(f"device {device.type}: PyTorch kernels")
        # the attention kernels also read bf16 caches (widened exactly, computed in fp32)
        c_attention = (
            library and device.type == "cpu" and not encoder and dtype in (torch.float32, torch.bfloat16)
        )
        if dtype != torch.float32:
            but = " but attention" if c_attention else ""
            reasons.append(
                f"dtype {str(dtype).removeprefix('torch.')}: PyTorch kernels{but} (ours compute fp32)"
            )
        native_path = library and device.type == "cpu" and dtype == torch.float32
        quantization = model_config.quantization
        if quantization != "none" and not native_path:
            raise ValueError(
                f"quantization={quantization!r} needs the CPU, float32 and the C kernels (native_kernels)."
            )
        if quantization != "none" and encoder:
            raise ValueError(f"quantization={quantization!r} is for decoders; {architecture} is an encoder.")
        int8_activations = quantization in ("gguf", "int8", "int4")
        decoder_kernels = native_path and not encoder  # our C decode attention, activation and step
        return cls(
            device=device,
            dtype=dtype,
            stored_weights=native_path and not encoder,
            quantization=quantization,
            int8_activations=int8_activations,
            block_rows=native.BLOCK_GEMV_MAX_ROWS if int8_activations else 0,
            int8_gemm=int8_activations and native_path and native.int8_gemm_available(),
            decode_attention=DecodeAttentionKernel.C if c_attention else DecodeAttentionKernel.TORCH,
            prefill_attention=PrefillAttentionKernel.C if c_attention else PrefillAttentionKernel.TORCH_SDPA,
            argmax=ArgmaxKernel.C if library and device.type == "cpu" and not encoder else ArgmaxKernel.TORCH,
            gated_activation=GatedActivationKernel.C if decoder_kernels else GatedActivationKernel.TORCH,
            fused_decode=decoder_kernels,
            reasons=tuple(reasons),
            encoder=encoder,
        )

    def without_fused_decode(self, reason: str) -> ExecutionPlan:
        """The plan once the built model turned out to have layers decoder_step.c cannot run (`reason`):
        its decode steps run op by op, through the same kernels."""
        return dataclasses.replace(
            self, fused_decode=False, reasons=(*self.reasons, f"{reason}: decodes run op by op")
        )

    def with_op_by_op_layers(self, layers: tuple[int, ...], reason: str) -> ExecutionPlan:
        """The plan once the built model turned out to have `layers` whose MLP decoder_step.c has no code
        for (`reason`): the fused step runs the others, these through PyTorch between its calls."""
        return dataclasses.replace(
            self, op_by_op_layers=layers, reasons=(*self.reasons, f"{reason}: they decode op by op")
        )

    def stored_product(self, rows: int) -> StoredProduct:
        """The kernel a stored weight multiplies `rows` rows with."""
        if not self.int8_activations:
            return StoredProduct.WEIGHT_GEMM
        if rows <= self.block_rows:
            return StoredProduct.BLOCKS_AS_INTEGERS
        if self.int8_gemm:
            return StoredProduct.INT8_GEMM
        return StoredProduct.ROUNDED_THEN_WEIGHT_GEMM

    def dense_product(self) -> DenseProduct:
        """The kernel a dense weight multiplies with: oneDNN's pre-packed product on the CPU in fp32, and in
        bf16 where the CPU has bf16 instructions (`F.linear`'s values up to the last bf16 rounding; F.linear
        packs the weight again at every call, 1.1-1.8x slower on SmolLM2's shapes), else `F.linear`."""
        if self.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return DenseProduct.TORCH
        if self.dtype == torch.float32 or (self.dtype == torch.bfloat16 and cpu_has_bf16_products()):
            return DenseProduct.ONEDNN
        return DenseProduct.TORCH

    def describe(self) -> list[str]:
        """A few lines for the start-up log."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.stored_weights:
            products = "stored weights in the checkpoint's format"
            if self.int8_activations:
                many = self.stored_product(self.block_rows + 1).value
                products += f", int8 activations: <= {self.block_rows} rows block_q8.c, more {many}"
            else:
                products += ", weight_gemm.c at every batch size"
        else:
            products = f"dense {dtype} weights through {self.dense_product().value}"
        lines = [f"Execution plan ({self.device.type}, {dtype}):", f"  projections: {products}"]
        if self.encoder:
            lines.append("  attention: bidirectional, torch SDPA per prompt (an encoder: no KV cache)")
        else:
            lines += [
                f"  decode attention: {self.decode_attention.value};"
                f" prefill attention: {self.prefill_attention.value}; sampling's argmax: {self.argmax.value}",
                f"  decode-only steps: {self._decode_steps()}",
                f"  MLP act(gate) * up outside decoder_step.c: {self.gated_activation.value}",
            ]
        lines += [f"  because: {reason}" for reason in self.reasons]
        return lines

    def _decode_steps(self) -> str:
        if not self.fused_decode:
            return "op by op"
        if not self.op_by_op_layers:
            return "every layer in one decoder_step.c call"
        layers = ", ".join(map(str, self.op_by_op_layers))
        return f"decoder_step.c, but layer(s) {layers} op by op between its calls"
