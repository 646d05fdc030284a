"""gguf, int8, int4 and fp16 (`--quantization`): int8 activations, and stored weights rounded at load.

gguf keeps a GGUF's blocks as they are (Q4_K, Q6_K, Q5_0, ...) and rounds the activations to int8 per
block of 32, which the blocks then multiply as integers (`kernels/block_q8.c`), as llama.cpp does: the
same bytes, several times fewer instructions per weight than widening each weight to fp32.

int8 and int4 round each projection and the output head into GGUF's blocks of 32 weights: Q8_0 (int8
values, one scale) or Q4_1 (4-bit values, a scale and a minimum), so decode steps stream a quarter or a
sixth of fp32's bytes, with the activations rounded as gguf rounds them. A weight already stored in
blocks (a GGUF) is widened to its fp32 values first. fp16 keeps 2-byte weights and fp32 activations.

With int8 activations, larger batches round them the same way (`native.round_rows`) before the fp32
kernels, so that outputs do not depend on the batch size.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.stored_weight import StoredTensor

BLOCK_TYPES = {"int8": GGMLQuantizationType.Q8_0, "int4": GGMLQuantizationType.Q4_1}
_BLOCK = 32


def requantize(parts: list[StoredTensor], quantization: str, name: str) -> list[StoredTensor]:
    """One weight's parts (of the weight `name`), stacked and rounded into one part of the format
    `quantization` names; with gguf, as they are, once checked to be blocks."""
    if quantization == "gguf":
        for part in parts:
            if not native.is_block_type(part.qtype):
                kind = GGMLQuantizationType(part.qtype).name
                raise ValueError(f"quantization='gguf' multiplies GGUF blocks; {name} is stored as {kind}.")
        return parts
    values = torch.cat([part.dequantize() for part in parts])
    if quantization == "fp16":
        return [StoredTensor.from_dense(values.half())]
    if values.shape[1] % _BLOCK:
        width = values.shape[1]
        raise ValueError(f"quantization={quantization!r} needs rows of 32k weights; a weight has {width}.")
    return [StoredTensor.rounded(values, BLOCK_TYPES[quantization])]
