"""A decoder layer's MLP role: what runs after the attention's residual add and the MLP's norm.

A dense layer fills it with `GatedMLP` (act(gate) * up → down), a Mixture-of-Experts layer with
`layers/moe.py`'s `SparseMoE`. Its `kind` says
whether the fused decode step (`kernels/decoder_step.c`) computes it: the plan runs the layers whose
kind it lacks through their PyTorch forward and the others in C (`native_decoder.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model_executor.execution_plan import ExecutionPlan, GatedActivationKernel
from llmserve.model_executor.kernels import native
from llmserve.model_executor.kernels.structs import MLPKind
from llmserve.model_executor.layers.linear import Linear

Activation = Literal["silu", "gelu_tanh"]
# gate_up [rows, 2 * inter] (each row's gate, then its up) → act(gate) * up [rows, inter]
GatedActivation = Callable[[torch.Tensor, Activation], torch.Tensor]


def torch_gated_activation(gate_up: torch.Tensor, activation: Activation) -> torch.Tensor:
    """act(gate) * up in PyTorch, for where the plan has no C kernels (GPUs, bf16)."""
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act.mul_(up)


class MLP(nn.Module):
    """x [rows, hidden] → [rows, hidden]. `kind`: how decoder_step.c names this MLP, None where it has no
    code for it (the layer then decodes op by op)."""

    kind: MLPKind | None = None

    def prepare(self, plan: ExecutionPlan) -> None:
        """The kernels the plan gives the MLP's own ops (its projections prepare themselves)."""


class GatedMLP(MLP):
    """down(act(gate) * up), gate and up in one projection: Llama's SwiGLU, Gemma's tanh GELU. Its
    modules carry the checkpoint's names (`gate_up_proj` fused from `gate_proj` and `up_proj`,
    `down_proj`); `shards`: the checkpoint tensors gate-up is made of (Phi-3 stores one)."""

    kind: MLPKind | None = MLPKind.GATED
    gated_activation: GatedActivation = staticmethod(torch_gated_activation)  # until `prepare`

    def __init__(
        self, hidden: int, intermediate: int, activation: Activation, stored: bool, shards: int = 2
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, False, stored, shards=shards)
        self.down_proj = Linear(intermediate, hidden, False, stored)
        self.intermediate = intermediate
        self.activation: Activation = activation

    def prepare(self, plan: ExecutionPlan) -> None:
        c_kernel = plan.gated_activation is GatedActivationKernel.C
        self.gated_activation = native.gated_activation if c_kernel else torch_gated_activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated_activation(self.gate_up_proj(x), self.activation))
