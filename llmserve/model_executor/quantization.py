"""int8 and int4 (`--quantization int8|int4`): weights rounded at load into GGUF's block formats.

Each projection and the output head become blocks of 32 weights: Q8_0 (int8 values, one scale) or
Q4_1 (4-bit values, a scale and a minimum): the formats our C kernels read, so small decode batches
stream a quarter (int8) or a sixth (int4) of fp32's bytes. The fp32 weights are overwritten with the
blocks' values, so larger batches, which keep oneDNN, compute with the same rounded weights. With the
C kernels the activations are rounded to int8 per block of 32 too (`kernels/block_q8.c`, and
`layers/linear.round_activations` for the larger batches): outputs do not depend on the batch size.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from llmserve.model_executor.layers.linear import Linear
from llmserve.model_executor.models.llama import LlamaForCausalLM

BLOCK_TYPES = {"int8": GGMLQuantizationType.Q8_0, "int4": GGMLQuantizationType.Q4_1}
_BLOCK = 32


@torch.no_grad()
def round_to_blocks(model: LlamaForCausalLM, quantization: str) -> list[tuple[str, int, torch.Tensor]]:
    """Quantize the model's projection weights in place; returns `(name, GGML type, blocks)` for
    `LlamaForCausalLM.attach_blocks`. With tied embeddings the input embedding is rounded too, as a
    GGUF's quantized token embedding would be."""
    qtype = BLOCK_TYPES[quantization]
    targets = [(f"{name}.weight", m.weight) for name, m in model.named_modules() if isinstance(m, Linear)]
    head = "lm_head.weight" if model.lm_head is not None else "embed_tokens.weight"
    targets.append((head, model.lm_head_weight))
    blocks = []
    for name, weight in targets:
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError(f"quantization={quantization!r} runs on CPU with dtype float32 only.")
        if weight.shape[1] % _BLOCK:
            width = weight.shape[1]
            raise ValueError(f"quantization={quantization!r} needs rows of 32k weights; {name} has {width}.")
        raw = quantize(weight.numpy(), qtype)
        weight.copy_(torch.from_numpy(dequantize(raw, qtype)))
        blocks.append((name, int(qtype), torch.from_numpy(raw)))
    return blocks
