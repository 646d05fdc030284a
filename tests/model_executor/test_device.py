"""The default dtype follows the hardware: bf16 only where the CPU multiplies it natively."""

from __future__ import annotations

import torch

from llmserve.model_executor.device import resolve_dtype

CPU = torch.device("cpu")


def test_auto_is_fp32_on_cpus_without_amx() -> None:
    assert resolve_dtype("auto", CPU, {"avx2", "fma", "avx512f"}) == torch.float32


def test_auto_is_bf16_on_cpus_with_amx() -> None:
    assert resolve_dtype("auto", CPU, {"avx512f", "amx_tile", "amx_bf16"}) == torch.bfloat16


def test_an_explicit_dtype_wins() -> None:
    assert resolve_dtype("float16", CPU, {"amx_bf16"}) == torch.float16
    assert resolve_dtype("float32", CPU, {"amx_bf16"}) == torch.float32
