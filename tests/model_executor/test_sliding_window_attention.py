"""Sliding-window attention over the paged KV cache against a windowed causal softmax written out in fp64
over the whole K and V: a query at position p sees the keys at (p - W, p] (Hugging Face's convention).

Every path (the C decode kernel under each instruction-set build, PyTorch's decode, fresh and chunked
prefills) must also never read a block wholly before the window: the blocks there hold NaN, which any
read would carry into the output (a NaN key makes a NaN score; a NaN value times a zero weight is NaN).
The last test hands such blocks, freed by the KV cache manager, to other requests that overwrite them.
Tolerance as in test_native_attention.py: fp32 paths, rounding near 1e-6.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from llmserve.model_executor.attention import AttentionMetadata, PrefillChunk, paged_attention
from llmserve.model_executor.kernels import native
from llmserve.model_executor.kernels.structs import MLPKind
from llmserve.scheduling.kv_cache_manager import KVCacheManager
from tests.model_executor.test_native_attention import reference_attention
from tests.scheduling.fake_requests import make_request

pytestmark = pytest.mark.usefixtures("native_library")

KV_HEADS = 2
TOL = 1e-5  # absolute and relative


class PagedSequences:
    """Sequences laid out in scattered blocks of a fresh cache: block 0 is the placeholder that tables
    hold for blocks behind a window (NaN: never to be read), block 1 the padding of short tables (1e4:
    PyTorch's decode may read it masked, so finite, and large enough to show if unmasked)."""

    def __init__(
        self, totals: list[int], block_size: int, head_dim: int, window: int | None, gen: torch.Generator
    ) -> None:
        self.block_size, self.window = block_size, window
        self.width = max(-(-n // block_size) for n in totals)
        num_blocks = 2 + sum(-(-n // block_size) for n in totals)
        shape = (KV_HEADS, num_blocks, block_size, head_dim)
        self.caches = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        self.full_tables = torch.ones(len(totals), self.width, dtype=torch.int64)
        ids = (torch.randperm(num_blocks - 2, generator=gen) + 2).tolist()
        for row, n in enumerate(totals):
            used = -(-n // block_size)
            self.full_tables[row, :used] = torch.tensor(ids[:used])
            ids = ids[used:]
        for cache in self.caches:
            cache[:, 0] = float("nan")
            cache[:, 1] = 1e4

    def cached(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's first `length` keys and values, [length, kv_heads, d]."""
        t = torch.arange(length)
        blocks = self.full_tables[row, t // self.block_size]
        k, v = (c[:, blocks, t % self.block_size].transpose(0, 1).clone() for c in self.caches)
        return k, v

    def table(self, row: int, first_query: int) -> torch.Tensor:
        """The row's table as the KV cache manager leaves it for queries from `first_query` on: the
        placeholder for each block wholly before that query's window."""
        table = self.full_tables[row].clone()
        if self.window is not None:
            table[: max(0, first_query - self.window + 1) // self.block_size] = 0
        return table


def slots_of(table: torch.Tensor, start: int, stop: int, block_size: int) -> torch.Tensor:
    t = torch.arange(start, stop)
    return table[t // block_size] * block_size + t % block_size


# (head_dim, block_size, group, window): vector and scalar paths, windows of one key, of less than a
# block, of several blocks, not a multiple of the block, and longer than every sequence.
DECODE_CASES = [(64, 16, 3, 1), (64, 16, 1, 7), (32, 16, 8, 37), (80, 5, 3, 12), (64, 4, 2, 300)]


@pytest.mark.parametrize(("head_dim", "block_size", "group", "window"), DECODE_CASES)
def test_decode_equals_windowed_reference(
    isa: str, head_dim: int, block_size: int, group: int, window: int
) -> None:
    """The C kernel and PyTorch's decode through `paged_attention`, at lengths shorter than, equal to and
    past the window, which starts at several offsets within a block across the rows."""
    gen = torch.Generator().manual_seed(head_dim + block_size + group + window)
    lens = [1, window, window + 1, 45, 131, 140]
    seqs = PagedSequences(lens, block_size, head_dim, window, gen)
    q = torch.randn(len(lens), KV_HEADS * group, head_dim, generator=gen) * 1.5
    scale = head_dim**-0.5
    cached = [seqs.cached(r, n) for r, n in enumerate(lens)]
    expected = torch.cat(
        [reference_attention(q[r : r + 1], *kv, scale, window) for r, kv in enumerate(cached)]
    )
    # This step's token is the last cached one: written again to its own slot, unchanged.
    k, v = (torch.stack([kv[i][-1] for kv in cached]) for i in (0, 1))
    tables = torch.stack([seqs.table(r, n - 1) for r, n in enumerate(lens)])
    slots = torch.cat([slots_of(tables[r], n - 1, n, block_size) for r, n in enumerate(lens)])
    for native_decode in (True, False):
        meta = AttentionMetadata(
            slots, len(lens), tables, torch.tensor(lens), max(lens), [], native_decode=native_decode
        )

        out = paged_attention(q, k, v, *seqs.caches, meta, scale, window)

        torch.testing.assert_close(out.double(), expected, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("head_dim", "group", "window"), [(64, 1, 10), (80, 3, 21), (32, 4, 1)])
def test_ragged_batch_equals_windowed_reference(head_dim: int, group: int, window: int, native: bool) -> None:
    """Two decodes past the window, fresh prefills longer and shorter than it, and a chunk starting
    mid-block after more context than the window, longer than the window itself, in one flat batch;
    through the C decode and prefill kernels, or through PyTorch."""
    block_size = 16
    gen = torch.Generator().manual_seed(head_dim + group + window)
    # (first new position, total) per sequence
    news = [(52, 53), (window, window + 1), (0, 3 * window), (0, max(1, window // 2)), (45, 45 + 2 * window)]
    seqs = PagedSequences([total for _, total in news], block_size, head_dim, window, gen)
    num_tokens = sum(total - first for first, total in news)
    heads = KV_HEADS * group
    q = torch.randn(num_tokens, heads, head_dim, generator=gen) * 1.5
    k = torch.randn(num_tokens, KV_HEADS, head_dim, generator=gen)
    v = torch.randn(num_tokens, KV_HEADS, head_dim, generator=gen)
    scale = head_dim**-0.5
    tables = [seqs.table(r, first) for r, (first, _) in enumerate(news)]
    expected, start = [], 0
    for r, (first, total) in enumerate(news):
        rows = slice(start, start + total - first)
        context_k, context_v = seqs.cached(r, first)
        keys, values = torch.cat([context_k, k[rows]]), torch.cat([context_v, v[rows]])
        expected.append(reference_attention(q[rows], keys, values, scale, window))
        start = rows.stop
    chunks, start = [], 2
    for r in range(2, len(news)):
        first, total = news[r]
        chunks.append(PrefillChunk(start, total - first, first, tables[r]))
        start += total - first
    meta = AttentionMetadata(
        slot_mapping=torch.cat([slots_of(t, *new, block_size) for t, new in zip(tables, news)]),
        num_decodes=2,
        decode_block_tables=torch.stack(tables[:2]),
        decode_seq_lens=torch.tensor([total for _, total in news[:2]]),
        decode_max_len=max(total for _, total in news[:2]),
        prefills=chunks,
        native_decode=native,
        native_prefill=native,
    )

    out = paged_attention(q, k, v, *seqs.caches, meta, scale, window)

    torch.testing.assert_close(out.double(), torch.cat(expected), rtol=TOL, atol=TOL)


def test_without_a_window_the_placeholder_would_be_read() -> None:
    """The NaN placeholder blocks are in reach: the same decode without the window reads them."""
    gen = torch.Generator().manual_seed(0)
    seqs = PagedSequences([40], 4, 32, 8, gen)
    q = torch.randn(1, KV_HEADS, 32, generator=gen)
    table = seqs.table(0, 39)[None]
    out = native.paged_decode_attention(q, *seqs.caches, table, torch.tensor([40]), 1.0)
    assert out.isnan().all()


def decoder_spec(
    weights: dict[str, torch.Tensor], caches: tuple[torch.Tensor, torch.Tensor], window: int
) -> tuple[native.DecoderSpec, ctypes.Array[native.LayerSpec]]:
    """A one-layer decoder over fp32 weights (the tensors must outlive the spec)."""

    def weight(t: torch.Tensor) -> native.Weight:
        parts = (native.WeightPart * native.MAX_WEIGHT_PARTS)(native.WeightPart(t.data_ptr(), 0, t.shape[0]))
        return native.Weight(parts, 1, None)

    kv_heads, num_blocks, block_size, head_dim = caches[0].shape
    hidden, intermediate = weights["o"].shape[0], weights["down"].shape[1]
    layers = (native.LayerSpec * 1)()
    layers[0] = native.LayerSpec(
        input_norm=weights["norm"].data_ptr(),
        post_norm=weights["norm"].data_ptr(),
        qkv=weight(weights["qkv"]),
        o=weight(weights["o"]),
        mlp_kind=MLPKind.GATED,
        gate_up=weight(weights["gate_up"]),
        down=weight(weights["down"]),
        intermediate=intermediate,
        activation=native.ACTIVATIONS["silu"],
        k_cache=caches[0].data_ptr(),
        v_cache=caches[1].data_ptr(),
        sliding_window=window,
        rope_cos=weights["cos"].data_ptr(),
        rope_sin=weights["sin"].data_ptr(),
    )
    spec = native.DecoderSpec(
        num_layers=1,
        hidden=hidden,
        num_heads=weights["o"].shape[1] // head_dim,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        num_blocks=num_blocks,
        block_size=block_size,
        rope_positions=weights["cos"].shape[0],
        eps=1e-6,
        scale=head_dim**-0.5,
        layers=ctypes.cast(layers, ctypes.POINTER(native.LayerSpec)),
        final_norm=weights["norm"].data_ptr(),
    )
    return spec, layers


def test_decoder_step_honours_the_layer_window() -> None:
    """A layer with window 9 at position 20 (blocks of 4) reads positions 12..20: the same as a layer
    without a window whose table starts at block 3 (RoPE follows the position, not the table), while
    blocks 0..2 hold NaN."""
    gen = torch.Generator().manual_seed(1)
    hidden, heads, head_dim, intermediate, block_size, window = 32, 4, 8, 64, 4, 9

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.3

    weights = {
        "norm": 1 + randn(hidden),
        "qkv": randn(heads * head_dim + 2 * KV_HEADS * head_dim, hidden),
        "o": randn(hidden, heads * head_dim),
        "gate_up": randn(2 * intermediate, hidden),
        "down": randn(hidden, intermediate),
        "cos": torch.cos(torch.rand(64, head_dim // 2, generator=gen) * 6),
        "sin": torch.sin(torch.rand(64, head_dim // 2, generator=gen) * 6),
    }
    caches = randn(KV_HEADS, 8, block_size, head_dim), randn(KV_HEADS, 8, block_size, head_dim)
    for cache in caches:
        cache[:, 0] = float("nan")
    full_table = torch.tensor([[0, 0, 0, 5, 2, 7]])  # positions 0..11 behind the window: the placeholder
    x = randn(1, hidden)
    position, slot = torch.tensor([20]), torch.tensor([7 * block_size])

    def step(table: torch.Tensor, length: int, layer_window: int) -> torch.Tensor:
        spec, _layers = decoder_spec(weights, caches, layer_window)
        return native.decoder_step(spec, x.clone(), position, slot, table, torch.tensor([length]))

    windowed = step(full_table, 21, window)
    assert torch.equal(windowed, step(full_table[:, 3:].contiguous(), 9, 0))
    assert step(full_table, 21, 0).isnan().all()  # the placeholder is in reach of a layer without one
    with pytest.raises(ValueError, match="out of bounds"):  # a position past the RoPE tables' 64 rows
        spec, _layers = decoder_spec(weights, caches, window)
        native.decoder_step(spec, x.clone(), torch.tensor([64]), slot, full_table, torch.tensor([21]))


@pytest.mark.parametrize("native", [True, False])
def test_blocks_freed_behind_the_window_can_be_overwritten(native: bool) -> None:
    """A request in chunks, then decodes, with its blocks from the KV cache manager: each step another
    request takes every free block (those freed behind the window among them) and overwrites it, and the
    first request's outputs still equal the reference over its whole history. NaN for the C kernels; 1e4
    for PyTorch's decode, which reads the tail of a sequence's last block masked (a fresh block's tail
    holds what its last owner left)."""
    block_size, window, head_dim, heads, num_blocks = 4, 6, 32, 4, 8
    fill = float("nan") if native else 1e4
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, sliding_window=window)
    caches = (
        torch.zeros(KV_HEADS, num_blocks, block_size, head_dim),
        torch.zeros(KV_HEADS, num_blocks, block_size, head_dim),
    )
    gen = torch.Generator().manual_seed(2)
    request = make_request("a", 40)
    history: list[tuple[torch.Tensor, torch.Tensor]] = []
    held_by_request: set[int] = set()
    overwritten: set[int] = set()
    other = None
    for i, n in enumerate([6, 5, 3] + [1] * 20):
        if other is not None:
            manager.free(other)
        start = request.num_computed_tokens
        assert manager.allocate_slots(request, n)
        block_ids = manager.get_block_ids("a")
        table = torch.tensor(block_ids)
        other = make_request(f"other{i}", manager.num_free_blocks * block_size)
        assert manager.allocate_slots(other, other.num_tokens)
        taken = manager.get_block_ids(other.request_id)
        for cache in caches:
            cache[:, taken] = fill
        overwritten |= set(taken) & held_by_request
        held_by_request |= set(block_ids[start // block_size :])
        q = torch.randn(n, heads, head_dim, generator=gen)
        k, v = (
            torch.randn(n, KV_HEADS, head_dim, generator=gen),
            torch.randn(n, KV_HEADS, head_dim, generator=gen),
        )
        slots = slots_of(table, start, start + n, block_size)
        if n == 1:
            meta = AttentionMetadata(slots, 1, table[None], torch.tensor([start + 1]), start + 1, [], native)
        else:
            meta = AttentionMetadata(
                slots,
                0,
                table[None, :0],
                torch.tensor([], dtype=torch.int64),
                0,
                [PrefillChunk(0, n, start, table)],
                native_prefill=native,
            )
        history.append((k, v))

        out = paged_attention(q, k, v, *caches, meta, 0.2, window)

        keys, values = (torch.cat([kv[j] for kv in history]) for j in (0, 1))
        torch.testing.assert_close(
            out.double(), reference_attention(q, keys, values, 0.2, window), rtol=TOL, atol=TOL
        )
        request.num_computed_tokens += n
    # The last step, from position 33, released the blocks of positions 0..27; others overwrote some.
    assert manager.num_window_released == 7
    assert overwritten
