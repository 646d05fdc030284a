"""Bidirectional attention over a packed batch of whole prompts, for encoders (no KV cache).

The batch's prompts lie one after another in the flat rows; each attends to all of its own tokens and
to no other prompt's. Consecutive prompts of the same length are one `scaled_dot_product_attention`
call on a 4-D view of their fused QKV rows (PyTorch's flash kernel on the CPU), so no row is padding
and nothing is copied in: a block-diagonal mask over the whole batch would multiply every prompt with
every other, and padding to the longest costs as much for a batch of mixed lengths. The runner orders
its batch by length, which makes such runs common among short prompts, where a call's overhead would
outweigh its work.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def encoder_attention(
    qkv: torch.Tensor,  # [num_tokens, 3 * num_heads * head_dim]: Q, K, V side by side
    seq_lens: list[int],  # the prompts' lengths, in the order of their rows; they sum to num_tokens
    num_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """→ [num_tokens, num_heads * head_dim], each prompt attended on its own, unmasked."""
    num_tokens, width = qkv.shape[0], num_heads * head_dim
    out = torch.empty(num_tokens, width, dtype=qkv.dtype, device=qkv.device)
    start = 0
    for length, run in itertools.groupby(seq_lens):
        count = len(list(run))
        rows = slice(start, start + count * length)
        # [count, length, 3, heads, d] → Q, K, V, each [count, heads, length, d]
        q, k, v = qkv[rows].view(count, length, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
        out[rows] = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, width)
        start += count * length
    return out
