"""A Mixture-of-Experts MLP: a router picks k of the experts for each row, each expert a `GatedMLP`.

Routing as `transformers` computes it for Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral: logits x W^T, a softmax
over every expert in fp32, the top k (ties to the lower index, torch.topk's rule on both sides), divided
by their sum where the config says (Mixtral always), cast to the rows' dtype.

Grouped products: one pass over the routing sorts a step's (row, choice) pairs by expert; every expert
some row chose multiplies all its rows at once, through its weights as the checkpoint stores them and the
plan's kernels (an expert's projections are `Linear`s like any other: requantized, prepared and counted
alike), and adds its output times the routing weight into those rows. Experts go in index order, so
each row's sum runs over its experts in the same order whatever else is in the batch, the order of
transformers' loop; a decode step reads only the chosen experts' bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model_executor.execution_plan import ExecutionPlan
from llmserve.model_executor.kernels.structs import MLPKind
from llmserve.model_executor.layers.linear import Linear
from llmserve.model_executor.layers.mlp import MLP, GatedMLP
from llmserve.model_executor.layers.stored_weight import StoredTensor, StoredWeight


class ExactProjection(nn.Module):
    """A small fp32 projection the plan never rounds (a router, a gate): with our kernels weight_gemm.c,
    whose sums do not depend on the batch, so neither does a row's choice of experts; F.linear elsewhere."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.stored: StoredWeight | None = None

    def prepare(self, plan: ExecutionPlan) -> None:
        if plan.stored_weights:
            self.stored = StoredWeight([StoredTensor.from_dense(self.weight.data)], None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stored(x) if self.stored is not None else F.linear(x, self.weight)


class Router(ExactProjection):
    """x [rows, hidden] → (routing weights [rows, k] in x's dtype, expert ids [rows, k])."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool) -> None:
        super().__init__(hidden, num_experts)
        self.top_k, self.normalize = top_k, normalize

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self(x), dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class SparseMoE(MLP):
    """Routed experts, and Qwen2-MoE's shared expert (every row, scaled by a sigmoid gate) beside them.
    Its modules carry the checkpoint's names: `gate` (the router), `experts.{e}`, `shared_expert`,
    `shared_expert_gate`. decoder_step.c computes the routed experts (MLPKind.EXPERTS), not a shared one."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        normalize: bool,
        stored: bool,
        shared_intermediate: int = 0,
    ) -> None:
        super().__init__()
        self.gate = Router(hidden, num_experts, top_k, normalize)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, intermediate, "silu", stored) for _ in range(num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: ExactProjection | None = None
        self.kind = None if shared_intermediate else MLPKind.EXPERTS
        if shared_intermediate:
            self.shared_expert = GatedMLP(hidden, shared_intermediate, "silu", stored)
            self.shared_expert_gate = ExactProjection(hidden, 1)

    def prepare(self, plan: ExecutionPlan) -> None:
        for module in self.modules():
            if module is not self and isinstance(module, (MLP, ExactProjection)):
                module.prepare(plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate.route(x)
        out = self.routed(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            out = out + shared
        return out

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts' outputs, weighted and summed per row in expert order."""
        out = torch.zeros_like(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (row, choice) pairs grouped by expert
        rows_in_order = order // ids.shape[1]
        weights_in_order = weights.flatten()[order].unsqueeze(1)
        start = 0
        for expert, count in enumerate(torch.bincount(flat, minlength=len(self.experts)).tolist()):
            if count:
                rows = rows_in_order[start : start + count]
                y = self.experts[expert](x.index_select(0, rows))
                out.index_add_(0, rows, y.mul_(weights_in_order[start : start + count]))
                start += count
        return out

    def inactive_parameters(self) -> int:
        """The expert weights a token does not read: all but k experts'."""
        one = self.experts[0].modules()
        expert = sum(linear.num_parameters for linear in one if isinstance(linear, Linear))
        return (len(self.experts) - self.gate.top_k) * expert
