"""LongRoPE and partial rotary against transformers' Phi-3: the tables, the rotation, the config reader."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.models.phi3 import modeling_phi3

import llmserve.model_executor.loader  # noqa: F401  (the loader first: models/ and loader/ import each other)
from llmserve.model_executor.layers.rotary_embedding import RotaryEmbedding, apply_rope
from llmserve.model_executor.models.phi3 import Phi3Config, Phi3ForCausalLM
from tests.fixtures.tiny_models import LONGROPE_ORIGINAL_CONTEXT, phi3_longrope_config


def hf_dict() -> dict[str, Any]:
    return phi3_longrope_config().to_dict()


def our_rotary(cfg: dict[str, Any]) -> RotaryEmbedding:
    return Phi3ForCausalLM(Phi3Config.from_hf_dict(cfg)).rotary


def hf_angles(rotary: torch.nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin [len, rotary_dim // 2] for one forward pass over `positions`."""
    cos, sin = rotary(torch.zeros(1), positions[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def test_longrope_rows_are_the_short_factors_then_the_long_ones() -> None:
    """transformers picks one set per pass: short for a pass within the original context, long for one
    past it. Our table holds the first for the positions before it and the second from there on, each
    scaled by the same attention factor."""
    config = phi3_longrope_config()
    hf = modeling_phi3.Phi3RotaryEmbedding(config)
    ours = our_rotary(hf_dict())
    assert hf.attention_scaling > 1.0  # max_position_embeddings is 16x the original context
    original = LONGROPE_ORIGINAL_CONTEXT
    short = torch.arange(original)
    long = torch.arange(original, config.max_position_embeddings)
    for positions in (short, long):
        cos, sin = hf_angles(hf, positions)
        torch.testing.assert_close(ours.cos[positions], cos, rtol=0, atol=0)
        torch.testing.assert_close(ours.sin[positions], sin, rtol=0, atol=0)


def test_older_configs_spell_longrope_su_beside_the_dict() -> None:
    """Phi-3-mini-128k's config.json (before transformers 5): rope_scaling {"type": "su"}, with
    original_max_position_embeddings and partial_rotary_factor at the top level."""
    new = hf_dict()
    rope = new["rope_parameters"]
    old = {
        **{k: v for k, v in new.items() if k != "rope_parameters"},
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {
            "type": "su",
            "short_factor": rope["short_factor"],
            "long_factor": rope["long_factor"],
        },
        "original_max_position_embeddings": rope["original_max_position_embeddings"],
        "partial_rotary_factor": rope["partial_rotary_factor"],
    }
    a, b = our_rotary(new), our_rotary(old)
    assert a.rotary_dim == b.rotary_dim == 12
    assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin)


def test_partial_rotary_turns_the_first_dimensions_only() -> None:
    torch.manual_seed(0)
    ours = our_rotary(hf_dict())
    q = torch.randn(5, 4, 16)  # [tokens, heads, head_dim]
    positions = torch.tensor([0, 3, 63, 64, 500])
    cos, sin = ours(positions)
    heads_first = q.transpose(0, 1)  # transformers' layout, [heads, tokens, head_dim]
    hf_cos, hf_sin = (torch.cat((t, t), -1).squeeze(1) for t in (cos, sin))  # [tokens, rotary_dim]
    expected, _ = modeling_phi3.apply_rotary_pos_emb(heads_first, heads_first, hf_cos, hf_sin, 0)
    turned = apply_rope(q, (cos, sin))
    torch.testing.assert_close(turned, expected.transpose(0, 1))
    assert torch.equal(turned[..., 12:], q[..., 12:]) and not torch.allclose(turned[..., :12], q[..., :12])


@pytest.mark.parametrize("field", ["short_factor", "long_factor"])
def test_a_factor_list_of_the_wrong_length_is_refused(field: str) -> None:
    cfg = hf_dict()
    cfg["rope_parameters"][field] = cfg["rope_parameters"][field][:-1]
    with pytest.raises(ValueError, match=field):
        our_rotary(cfg)
