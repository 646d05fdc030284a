"""The routing of each MoE family's block against transformers' own block on the same weights: the same
experts for every row and the same output, in batches of 1 and 300 rows, when every row takes one expert
and most experts none, and when router logits tie."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
import transformers

from llmserve.model_executor.layers.mlp import GatedMLP
from llmserve.model_executor.layers.moe import SparseMoE
from tests.fixtures.tiny_moe import MOE_FAMILIES, moe_config


def hf_block_and_ours(family: str) -> tuple[Any, SparseMoE]:
    """transformers' first MoE block of the tiny `family` and ours (dense PyTorch weights) holding its
    weights."""
    torch.manual_seed(0)
    config = moe_config(family)
    hf: Any = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].mlp.eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.2)
    width = hf.experts.down_proj.shape[-1]
    shared = hf.shared_expert.down_proj.in_features if hasattr(hf, "shared_expert") else 0
    top_k, normalize = hf.gate.top_k, family == "mixtral" or bool(getattr(config, "norm_topk_prob", False))
    ours = SparseMoE(config.hidden_size, width, hf.gate.num_experts, top_k, normalize, False, shared)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        for e, module in enumerate(ours.experts):
            expert = cast(GatedMLP, module)
            assert expert.gate_up_proj.weight is not None and expert.down_proj.weight is not None
            expert.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])  # the gate's rows, then the up's
            expert.down_proj.weight.copy_(hf.experts.down_proj[e])
        if ours.shared_expert is not None and ours.shared_expert_gate is not None:
            s = hf.shared_expert
            assert ours.shared_expert.gate_up_proj.weight is not None
            assert ours.shared_expert.down_proj.weight is not None
            ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
            ours.shared_expert.down_proj.weight.copy_(s.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    return hf, ours


def assert_same_routing_and_output(hf: Any, ours: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Our expert ids; they equal transformers', and our block's output its."""
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x)
        weights, ids = ours.gate.route(x)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)
        torch.testing.assert_close(ours(x), hf(x.unsqueeze(0)).squeeze(0), rtol=1e-5, atol=1e-6)
    return ids


@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routing_matches_transformers(family: str, rows: int) -> None:
    hf, ours = hf_block_and_ours(family)
    x = torch.randn(rows, hf.gate.hidden_dim, generator=torch.Generator().manual_seed(rows))
    ids = assert_same_routing_and_output(hf, ours, x)
    if rows == 300:  # every expert took some rows
        assert set(ids.flatten().tolist()) == set(range(hf.gate.num_experts))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_row_to_one_expert_and_others_to_none(family: str) -> None:
    """Expert 3's router row dominates positive inputs: every row takes it, most experts no row."""
    hf, ours = hf_block_and_ours(family)
    with torch.no_grad():
        for module in (hf.gate, ours.gate):
            module.weight[3] = 1.0
    x = torch.rand(40, hf.gate.hidden_dim, generator=torch.Generator().manual_seed(1)) + 0.5
    ids = assert_same_routing_and_output(hf, ours, x)
    assert (ids == 3).any(dim=1).all()
    assert len(set(ids.flatten().tolist())) < hf.gate.num_experts


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_ties_in_the_router_logits_break_as_transformers_breaks_them(family: str) -> None:
    """Experts 2, 5 and 6 share one router row, above the others: a 3-way tie for 2 places."""
    hf, ours = hf_block_and_ours(family)
    with torch.no_grad():
        for module in (hf.gate, ours.gate):
            module.weight[[2, 5, 6]] = 1.0
    x = torch.rand(16, hf.gate.hidden_dim, generator=torch.Generator().manual_seed(2)) + 0.5
    ids = assert_same_routing_and_output(hf, ours, x)
    assert set(ids.flatten().tolist()) <= {2, 5, 6}
