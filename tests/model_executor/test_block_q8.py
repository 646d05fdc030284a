"""block_q8.c, the few rows of a decode step with int8 activations against Q4_1/Q8_0 blocks, computes the
rounded x @ W.T for the dequantized W, under every instruction-set build this CPU runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from llmserve.model_executor.kernels import native

round_activations = native.round_rows


@pytest.fixture(autouse=True, params=native.supported_isas())
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("LLMSERVE_CPU_ISA", request.param)
    assert native.load_library() is not None, "the C kernels must build here"
    return str(request.param)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("rows", [1, 5, native.BLOCK_GEMV_MAX_ROWS])
def test_int8_activations_are_rounded_as_round_activations_rounds_them(qtype: Q, rows: int) -> None:
    rng = np.random.default_rng(rows + 7)
    weight = rng.standard_normal((64, 256)).astype(np.float32)
    blocks = quantize(weight, qtype)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, 32:64] = 0.0  # a block of zeros: scale 0
    rounded = round_activations(x)
    assert not torch.equal(rounded, x)
    expected = rounded @ torch.from_numpy(dequantize(blocks, qtype)).T
    actual = native.block_gemv(x, torch.from_numpy(blocks), int(qtype), 64)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)


def test_round_activations_keeps_int8_steps_per_block() -> None:
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(3))
    blocks = x.reshape(3, 3, 32)
    steps = round_activations(x).reshape(3, 3, 32) / (blocks.abs().amax(-1, keepdim=True) / 127)
    torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)
    torch.testing.assert_close(steps.abs().amax(-1), torch.full((3, 3), 127.0))  # the block's largest


def test_block_gemv_refuses_what_it_cannot_read() -> None:
    blocks = torch.from_numpy(quantize(np.ones((4, 64), np.float32), Q.Q8_0))
    with pytest.raises(ValueError, match="block type"):
        native.block_gemv(torch.ones(native.BLOCK_GEMV_MAX_ROWS + 1, 64), blocks, int(Q.Q8_0), 4)
    with pytest.raises(ValueError, match="block type"):
        native.block_gemv(torch.ones(1, 64), blocks, int(Q.Q5_0), 4)
