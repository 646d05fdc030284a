"""gated_activation.c, the MLP's act(gate) * up that decode steps (decoder_step.c) and, through the plan,
the layers' PyTorch forward both run, against PyTorch's silu and tanh GELU under every instruction-set
build this CPU runs: within a few ulp on random rows of every length class, and the same special
values (-0.0, infinities, NaN) where e^x's clamp could make them differ."""

from __future__ import annotations

import pytest
import torch

from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.mlp import Activation, torch_gated_activation

ACTIVATIONS: list[Activation] = ["silu", "gelu_tanh"]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("inter", [1, 7, 8, 16, 17, 100, 1536])
def test_random_rows_match_torch(isa: str, activation: Activation, inter: int) -> None:
    gate_up = 4 * torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(inter))
    ours = native.gated_activation(gate_up, activation)
    # atol: where tanh(u) nears -1, PyTorch's 1 + tanh(u) keeps few bits (0 below u = -9), ours e^2u all
    torch.testing.assert_close(ours, torch_gated_activation(gate_up, activation), rtol=4e-6, atol=4e-6)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_special_values_match_torch(isa: str, activation: Activation) -> None:
    gate = torch.tensor(
        [-1e38, -1e3, -100.0, -88.5, -87.0, -20.0, -0.0, 0.0, 1e-30, 20.0, 1e38]
        + [float("inf"), float("-inf"), float("nan"), -3.0, 3.0, 0.5]
    )
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)]).unsqueeze(0)
    ours, ref = native.gated_activation(gate_up, activation), torch_gated_activation(gate_up, activation)
    # atol: below z = -88 ours is x * 0 where PyTorch's is a denormal; GELU(-3) as in the random rows
    torch.testing.assert_close(ours, ref, rtol=4e-6, atol=1e-6, equal_nan=True)
    assert torch.equal(torch.signbit(ours), torch.signbit(ref)), (ours, ref)  # -0.0 where PyTorch's is


def test_rows_of_an_odd_width_are_refused() -> None:
    with pytest.raises(ValueError, match="gate and an up"):
        native.gated_activation(torch.zeros(2, 7), "silu")
