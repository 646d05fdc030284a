"""The default dtype: fp32, the exact path, on every CPU; bf16 on GPUs; an explicit one wins."""

from __future__ import annotations

import torch

from llmserve.model_executor.device import resolve_dtype

CPU = torch.device("cpu")


def test_auto_is_fp32_on_cpus() -> None:
    assert resolve_dtype("auto", CPU) == torch.float32


def test_auto_is_bf16_on_gpus() -> None:
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_an_explicit_dtype_wins() -> None:
    assert resolve_dtype("float16", CPU) == torch.float16
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
