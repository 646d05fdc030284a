"""Attention over the paged KV cache for a ragged batch of decodes and prefill chunks.

The flattened batch holds the decode tokens first (one per sequence), then each prefill chunk. Decodes
are attended in one batched call over gathered blocks; prefill chunks one sequence at a time (there are
few, and each is a large matrix product already).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """`query_len` tokens at `[query_start, query_start + query_len)` of the flat batch, whose sequence
    already has `context_len` tokens in the cache before them."""

    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot for each token's K and V
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with 0
    decode_seq_lens: torch.Tensor  # [num_decodes] int64, including the new token
    decode_max_len: int
    prefills: list[PrefillChunk]


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store this step's keys and values ([num_tokens, kv_heads, head_dim]) in their cache slots."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.num_decodes:
        n = meta.num_decodes
        out[:n] = _decode_attention(q[:n], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        if chunk.context_len == 0:
            out[rows] = _attend(q[rows], k[rows], v[rows], None, scale, causal=True)
        else:
            out[rows] = _prefill_with_context(q[rows], k_cache, v_cache, chunk, scale)
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[..., num_blocks] block ids → [..., length, kv_heads, head_dim] cached tokens."""
    blocks = cache[block_table]  # [..., num_blocks, block_size, kv_heads, head_dim]
    flat = blocks.flatten(-4, -3)
    return flat[..., :length, :, :]


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    length = meta.decode_max_len
    keys = _gather(k_cache, meta.decode_block_tables, length)  # [B, L, kv_heads, head_dim]
    values = _gather(v_cache, meta.decode_block_tables, length)
    positions = torch.arange(length, device=q.device)
    mask = positions[None, :] < meta.decode_seq_lens[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, heads, 1, head_dim]
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def _prefill_with_context(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PrefillChunk, scale: float
) -> torch.Tensor:
    total = chunk.context_len + chunk.query_len
    keys = _gather(k_cache, chunk.block_table, total)  # [total, kv_heads, head_dim]
    values = _gather(v_cache, chunk.block_table, total)
    query_pos = torch.arange(chunk.context_len, total, device=q.device)
    key_pos = torch.arange(total, device=q.device)
    mask = key_pos[None, :] <= query_pos[:, None]  # [query_len, total]
    return _attend(q, keys, values, mask, scale, causal=False)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """One sequence: q [q_len, heads, d], k/v [kv_len, kv_heads, d] → [q_len, heads, d]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)
