"""int8, int4 and fp16 (`--quantization`): stored weights rounded at load into smaller formats.

int8 and int4 round each projection and the output head into GGUF's blocks of 32 weights: Q8_0 (int8
values, one scale) or Q4_1 (4-bit values, a scale and a minimum), so decode steps stream a quarter or a
sixth of fp32's bytes; the activations are rounded to int8 per block of 32 too (`kernels/block_q8.c`, and
`native.round_rows` for the larger batches), so that outputs do not depend on the batch size. fp16 keeps
2-byte weights and fp32 activations. A weight already stored in blocks (a GGUF) is widened to its fp32
values first.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from llmserve.model_executor.layers.stored_weight import StoredTensor

BLOCK_TYPES = {"int8": GGMLQuantizationType.Q8_0, "int4": GGMLQuantizationType.Q4_1}
_BLOCK = 32


def requantize(parts: list[StoredTensor], quantization: str) -> list[StoredTensor]:
    """One weight's parts, stacked and rounded into one part of the format `quantization` names."""
    values = torch.cat([part.dequantize() for part in parts])
    if quantization == "fp16":
        return [StoredTensor.from_dense(values.half())]
    if values.shape[1] % _BLOCK:
        width = values.shape[1]
        raise ValueError(f"quantization={quantization!r} needs rows of 32k weights; a weight has {width}.")
    return [StoredTensor.rounded(values, BLOCK_TYPES[quantization])]
