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
# AVX512-BF16, 0.036 / 0.29 with AMX.
BOUNDS = {"fp16": (0.01, 0.05), "gguf": (0.08, 0.7), "int8": (0.1, 1.0), "int4": (0.5, 5.0)}
BF16_BOUNDS = (0.07, 0.6)


@pytest.mark.parametrize("quantization", ["fp16", "gguf", "int8", "int4"])
def test_quantized_weights_drift_little_from_fp32(llm: LLM, quantization: str) -> None:
    quantized = LLM(quantization=quantization, kv_cache_memory=128 << 20, multiprocess=False)
    try:
        drifts = prompt_logprob_drifts(llm, quantized, PROMPTS)
    finally:
        quantized.shutdown()
    mean, largest = sum(drifts) / len(drifts), max(drifts)
    print(f"{quantization}: mean |d logprob| {mean:.4f}, largest {largest:.4f}")
    assert 0 < mean < BOUNDS[quantization][0]
    assert largest < BOUNDS[quantization][1]


def test_bfloat16_drifts_little_from_fp32(llm: LLM) -> None:
    bf16 = LLM(dtype="bfloat16", kv_cache_memory=128 << 20, multiprocess=False)
    try:
        drifts = prompt_logprob_drifts(llm, bf16, PROMPTS)
    finally:
        bf16.shutdown()
    mean, largest = sum(drifts) / len(drifts), max(drifts)
    print(f"bfloat16: mean |d logprob| {mean:.4f}, largest {largest:.4f}")
    assert 0 < mean < BF16_BOUNDS[0]
    assert largest < BF16_BOUNDS[1]
