"""Attention over the paged KV cache for a ragged batch of decodes and prefill chunks.

The flattened batch holds the decode rows first (one per sequence, or with speculative guesses one per
token of its sequence, each with its own length), then each prefill chunk. Decodes are attended in one
call: on CPU, from fp32 or bf16 caches, by our C kernel (`kernels/paged_attention.c`, computing in
fp32), which reads the blocks in place, else by PyTorch over gathered blocks. Prefill chunks go one
sequence at a time: on CPU, from the same caches, through `kernels/prefill_attention.c`, which reads the
chunk's keys and values in place once this step's are written (2.7x PyTorch's flash attention on
SmolLM2's prompts of 32-512 tokens), else through `scaled_dot_product_attention`.

The cache is head-major, `[kv_heads, num_blocks, block_size, head_dim]`, so that gathering a batch's
blocks yields `[kv_heads, batch, tokens, head_dim]` directly: one copy, and the matrix products read
it as it lies; the C kernel reads one head's block as 16 contiguous rows.

A layer with a sliding window W lets the query at position p see the keys at (p - W, p] (Hugging Face's
convention: W keys, its own included). Every path then starts at the block holding p - W + 1 and never
reads one before it: behind the window the KV cache manager frees blocks, which another request may
take and overwrite, and leaves a placeholder id in their place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmserve.model_executor.kernels import native


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
    decode_block_tables: torch.Tensor  # [num_decodes, width] int64, padded with valid block ids
    decode_seq_lens: torch.Tensor  # [num_decodes] int64, including the new token
    decode_max_len: int
    prefills: list[PrefillChunk]
    native_decode: bool = False  # through kernels/paged_attention.c (CPU, fp32 or bf16, when it built)
    native_prefill: bool = False  # through kernels/prefill_attention.c (CPU, fp32 or bf16, when it built)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store this step's keys and values ([num_tokens, kv_heads, head_dim]) in their cache slots, rounded
    to the cache's dtype (`--kv-cache-dtype`)."""
    num_kv_heads, _, _, head_dim = k_cache.shape
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Writes this step's K and V to the cache, then attends each query to its sequence's keys up to its
    own position, or to the last `sliding_window` of them."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}.")
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.num_decodes:
        n = meta.num_decodes
        if meta.native_decode:
            out[:n] = native.paged_decode_attention(
                q[:n], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale, sliding_window
            )
        else:
            out[:n] = _decode_attention(q[:n], k_cache, v_cache, meta, scale, sliding_window)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        if meta.native_prefill:
            attended = native.prefill_attention(
                q[rows].contiguous(),
                k_cache,
                v_cache,
                chunk.block_table,
                chunk.context_len,
                scale,
                sliding_window,
            )
            if attended is not None:  # else a head_dim the C kernel's vectors do not divide
                out[rows] = attended
                continue
        if chunk.context_len == 0:
            mask = None  # causal, which is the window too while the chunk is no longer than it
            if sliding_window is not None and chunk.query_len > sliding_window:
                positions = torch.arange(chunk.query_len, device=q.device)
                mask = _visible(positions, positions, sliding_window)
            # the keys and values as the cache holds them, as every other path reads them
            keys, values = (t[rows].to(k_cache.dtype).to(q.dtype).transpose(0, 1) for t in (k, v))
            out[rows] = _prefill(q[rows], keys, values, mask, scale)
        else:
            out[rows] = _prefill_with_context(q[rows], k_cache, v_cache, chunk, scale, sliding_window)
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Block ids [..., num_blocks] → their tokens [kv_heads, ..., num_blocks * block_size, head_dim], in
    `dtype` (the queries')."""
    blocks = cache[:, block_table]  # [kv_heads, ..., num_blocks, block_size, head_dim]
    return blocks.flatten(-3, -2).to(dtype)


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[q_len, kv_len]: whether each query sees each key (causal, and within the window if any)."""
    seen = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        seen &= key_pos[None, :] > query_pos[:, None] - window
    return seen


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q [batch, heads, head_dim] → [batch, heads, head_dim], one query per row: each row reads
    `count` blocks of its table from its `first`, masking the keys outside its window or past its length."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    lens, tables = meta.decode_seq_lens, meta.decode_block_tables
    count = -(-meta.decode_max_len // block_size)
    first = torch.zeros_like(lens)
    if window is not None:
        # (p - W, p] spans at most this many blocks, wherever it starts in one.
        count = min(count, -(-(window - 1) // block_size) + 1)
        first = (lens - window).clamp(min=0) // block_size
    # Past a short row's table the ids are clamped to its (valid) padding; those keys are masked.
    ids = (first[:, None] + torch.arange(count, device=q.device)).clamp(max=tables.shape[1] - 1)
    row_tables = tables.gather(1, ids)  # [batch, count]
    keys = _gather(k_cache, row_tables, q.dtype)  # [kv_heads, batch, L, head_dim]
    values = _gather(v_cache, row_tables, q.dtype)
    # The query heads that share a KV head become rows of one matrix product per (kv head, sequence).
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(scale)  # [kv_heads, batch, group, L]
    key_pos = first[:, None] * block_size + torch.arange(count * block_size, device=q.device)  # [batch, L]
    hidden = key_pos >= lens[:, None]
    if window is not None:
        hidden |= key_pos < (lens - window)[:, None]
    scores.masked_fill_(hidden[None, :, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), values)  # [kv_heads, batch, group, head_dim]
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim)


def _prefill_with_context(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """The chunk's queries against its cached and new keys, from the block holding the first key its
    first query sees."""
    block_size = k_cache.shape[2]
    total = chunk.context_len + chunk.query_len
    start = 0 if window is None else max(0, chunk.context_len - window + 1) // block_size * block_size
    table = chunk.block_table[start // block_size : -(-total // block_size)]
    keys = _gather(k_cache, table, q.dtype)[:, : total - start]  # [kv_heads, total - start, head_dim]
    values = _gather(v_cache, table, q.dtype)[:, : total - start]
    query_pos = torch.arange(chunk.context_len, total, device=q.device)
    key_pos = torch.arange(start, total, device=q.device)
    return _prefill(q, keys, values, _visible(query_pos, key_pos, window), scale)


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One sequence: q [q_len, heads, d], k/v [kv_heads, kv_len, d] → [q_len, heads, d]; causal when
    `mask` is None (queries and keys then cover the same positions). Batched 4-D inputs take PyTorch's
    flash kernel on CPU, 3-D ones its math fallback (4.7x slower here)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k[None],
        v[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
