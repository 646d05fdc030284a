"""Quantization and bf16 on the real model: their logprobs drift from fp32 on the checks' prompts."""

from __future__ import annotations

import pytest

from llmserve import LLM
from tests.e2e.conftest import PROMPTS
from tests.e2e.logprob_drift import prompt_logprob_drifts

# Measured on SmolLM2-135M (whose GGUF weights are Q4_1 already): mean and largest |Δ logprob| of the
# prompt tokens against fp32: fp16 0.0013 / 0.010, gguf 0.044 / 0.34 (the activations rounded to int8 per
# block of 32, the weights as stored), int8 0.061 / 0.50, int4 0.21 / 2.1 (int8 and int4 round those
# weights again, into blocks of 32, and the activations too; weights alone gave int8 0.036 / 0.26, int4
# 0.20 / 1.6). `--dtype bfloat16` (activations and products in bf16, through oneDNN): 0.035 / 0.19 with
# AVX512-BF16, 0.036 / 0.29 with AMX. `--kv-cache-dtype bfloat16` (keys and values rounded to bf16, all
# else fp32): 0.0034 / 0.020.
#
# Engine options against the exact fp32 default → (largest mean, largest single) |Δ logprob|.
BOUNDS: dict[str, tuple[dict[str, str], float, float]] = {
    "fp16": ({"quantization": "fp16"}, 0.01, 0.05),
    "gguf": ({"quantization": "gguf"}, 0.08, 0.7),
    "int8": ({"quantization": "int8"}, 0.1, 1.0),
    "int4": ({"quantization": "int4"}, 0.5, 5.0),
    "bfloat16": ({"dtype": "bfloat16"}, 0.07, 0.6),
    "kv_bfloat16": ({"kv_cache_dtype": "bfloat16"}, 0.01, 0.1),
}


@pytest.mark.parametrize("variant", list(BOUNDS))
def test_quantized_or_bf16_drifts_little_from_fp32(llm: LLM, variant: str) -> None:
    options, mean_bound, largest_bound = BOUNDS[variant]
    other = LLM(kv_cache_memory=128 << 20, multiprocess=False, **options)
    try:
        drifts = prompt_logprob_drifts(llm, other, PROMPTS)
    finally:
        other.shutdown()
    mean, largest = sum(drifts) / len(drifts), max(drifts)
    print(f"{variant}: mean |d logprob| {mean:.4f}, largest {largest:.4f}")
    assert 0 < mean < mean_bound
    assert largest < largest_bound
