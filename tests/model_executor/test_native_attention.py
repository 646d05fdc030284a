"""Attention over the paged KV cache against softmax(q k^T * scale) v written out in fp64 here: our C
decode and prefill kernels under every instruction-set build this CPU runs, and the whole ragged-batch
entry point (`paged_attention`: cache writes, decodes, fresh and chunked prefills, through the C kernels
or PyTorch's).

Tolerance: every path computes in fp32 (unit roundoff 6e-8). A score is a dot product of `head_dim`
terms and an output a convex combination of up to ~160 value rows of magnitude ~1, so the accumulated
rounding stays near 1e-6 (2.2e-6 the most measured); 1e-5 (absolute and relative) leaves margin for the
kernel's exp polynomial (2 ulp) and summation order, while a scale 0.1% off already moves outputs by
~1e-3, and a missed or extra key or a wrong head pairing by far more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmserve.model_executor.attention import AttentionMetadata, PrefillChunk, paged_attention
from llmserve.model_executor.kernels import native

pytestmark = pytest.mark.usefixtures("native_library")

KV_HEADS = 2


def reference_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """One sequence in fp64: q [q_len, heads, d] are the last q_len of the kv_len positions whose keys and
    values are [kv_len, kv_heads, d]; each query sees the keys up to its own position, only the last
    `window` of them where there is one. → [q_len, heads, d]"""
    q_len, heads, _ = q.shape
    kv_len, kv_heads, _ = keys.shape
    group = heads // kv_heads  # query head h reads KV head h // group
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, kv_len, d]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, q_len, kv_len]
    query_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    key_pos = torch.arange(kv_len)[None, :]
    hidden = key_pos > query_pos
    if window is not None:
        hidden |= key_pos <= query_pos - window
    return (scores.masked_fill(hidden, float("-inf")).softmax(dim=-1) @ v).transpose(0, 1)


def cached(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Token t of a sequence lies in block table[t // block_size] at offset t % block_size.
    → [length, kv_heads, d]"""
    t = torch.arange(length)
    block_size = cache.shape[2]
    return cache[:, table[t // block_size], t % block_size].transpose(0, 1)


def block_tables(
    lens: list[int], width: int, block_size: int, num_blocks: int, gen: torch.Generator
) -> torch.Tensor:
    """Distinct scattered blocks for each sequence; unused entries point at the last block, kept out of
    every sequence (the tests fill it with NaN)."""
    free = torch.randperm(num_blocks - 1, generator=gen)
    tables = torch.full((len(lens), width), num_blocks - 1, dtype=torch.int64)
    taken = 0
    for row, length in enumerate(lens):
        used = -(-length // block_size)
        tables[row, :used] = free[taken : taken + used]
        taken += used
    return tables


def poison_unused(
    caches: tuple[torch.Tensor, torch.Tensor], tables: torch.Tensor, lens: list[int], value: float
) -> None:
    """`value` in the padding block and in each sequence's last block past its length: read, it would
    show. NaN for the C kernel, which must never read them; the PyTorch decode reads them and masks them
    out, so for it they must stay finite (its runner zeroes the cache), and 1e4 would show if unmasked."""
    block_size = caches[0].shape[2]
    for cache in caches:
        cache[:, -1] = value
        for table, length in zip(tables, lens):
            if length % block_size:
                cache[:, table[(length - 1) // block_size], length % block_size :] = value


HEAD_DIMS = [32, 64, 80, 128]  # 80: the 64-wide loop, then 8-wide tails
BLOCK_SIZES = [16, 32, 5]  # 5: the scalar path even where there are vectors
GROUPS = [1, 3, 8]  # query heads per KV head
# Every head dim with every block size, and each of those with every group size (pairwise, not all 36).
DECODE_CASES = [
    (head_dim, block_size, GROUPS[(i + j) % len(GROUPS)])
    for i, head_dim in enumerate(HEAD_DIMS)
    for j, block_size in enumerate(BLOCK_SIZES)
]


@pytest.mark.parametrize(("head_dim", "block_size", "group"), DECODE_CASES)
def test_native_decode_equals_fp64_attention(isa: str, head_dim: int, block_size: int, group: int) -> None:
    """Lengths that are multiples of nothing leave every vector loop a scalar tail; a full table reads the
    last slot of every block."""
    gen = torch.Generator().manual_seed(head_dim * 1000 + block_size * 10 + group)
    width = -(-140 // block_size)
    lens = [1, 17, 45, 131, width * block_size]
    num_blocks = len(lens) * width + 1
    shape = (KV_HEADS, num_blocks, block_size, head_dim)
    caches = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = block_tables(lens, width, block_size, num_blocks, gen)
    q = torch.randn(len(lens), KV_HEADS * group, head_dim, generator=gen) * 1.5  # some peaked rows
    scale = head_dim**-0.5
    expected = [
        reference_attention(
            q[row : row + 1], cached(caches[0], table, n), cached(caches[1], table, n), scale
        )[0]
        for row, (table, n) in enumerate(zip(tables, lens))
    ]
    poison_unused(caches, tables, lens, float("nan"))

    actual = native.paged_decode_attention(q, *caches, tables, torch.tensor(lens), scale)

    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), torch.stack(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("head_dim", "block_size", "group"), DECODE_CASES[::2])
def test_native_decode_reads_bf16_caches_as_their_fp32_values(
    isa: str, head_dim: int, block_size: int, group: int
) -> None:
    """`--dtype bfloat16`: a bf16 cache widens exactly and is computed with in fp32, so the output is the
    fp32 kernel's on the widened values, rounded to bf16 once; and within that rounding of fp64. Under
    `--kv-cache-dtype bfloat16` the fp32 queries' output is the fp32 kernel's, unrounded."""
    gen = torch.Generator().manual_seed(head_dim + block_size + group)
    width = -(-140 // block_size)
    lens = [1, 17, 45, 131, width * block_size]
    num_blocks = len(lens) * width + 1
    shape = (KV_HEADS, num_blocks, block_size, head_dim)
    caches = torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16()
    tables = block_tables(lens, width, block_size, num_blocks, gen)
    q = (torch.randn(len(lens), KV_HEADS * group, head_dim, generator=gen) * 1.5).bfloat16()
    scale = head_dim**-0.5
    poison_unused(caches, tables, lens, float("nan"))
    seq_lens = torch.tensor(lens)

    actual = native.paged_decode_attention(q, *caches, tables, seq_lens, scale)
    widened = native.paged_decode_attention(
        q.float(), caches[0].float(), caches[1].float(), tables, seq_lens, scale
    )

    assert actual.dtype == torch.bfloat16
    assert torch.equal(actual, widened.bfloat16())
    assert torch.equal(native.paged_decode_attention(q.float(), *caches, tables, seq_lens, scale), widened)
    expected = torch.stack(
        [
            reference_attention(
                q[row : row + 1].float(),
                cached(caches[0], table, n).float(),
                cached(caches[1], table, n).float(),
                scale,
            )[0]
            for row, (table, n) in enumerate(zip(tables, lens))
        ]
    )
    torch.testing.assert_close(actual.double(), expected, rtol=2**-8, atol=1e-6)


def test_native_decode_refuses_a_half_cache() -> None:
    cache = torch.zeros(KV_HEADS, 2, 16, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        native.paged_decode_attention(
            torch.zeros(1, KV_HEADS, 64, dtype=torch.float16),
            cache,
            cache,
            torch.zeros(1, 1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            1.0,
        )


# (head_dim, block_size, group, context, new tokens, window): fresh prompts shorter and longer than a
# chunk of the kernel's keys (64 on AVX-512), a chunk after context that starts mid-block, windows
# shorter than the chunk and reaching back into the context; 36 is a multiple of the portable build's
# vectors only (the others answer None; paged_attention then takes PyTorch's path, tested below).
PREFILL_CASES = [
    (64, 16, 3, 0, 37, None),
    (64, 16, 3, 0, 300, None),
    (128, 32, 8, 45, 70, None),
    (32, 5, 1, 0, 131, 20),
    (80, 16, 3, 100, 90, 150),
    (36, 16, 2, 7, 9, None),
    (256, 16, 4, 0, 200, 64),
    (64, 8, 7, 250, 1, 100),
]


@pytest.mark.parametrize(("head_dim", "block_size", "group", "context", "new", "window"), PREFILL_CASES)
def test_native_prefill_equals_fp64_attention(
    isa: str, head_dim: int, block_size: int, group: int, context: int, new: int, window: int | None
) -> None:
    """The chunk's queries against their sequence's keys in place: NaN in every slot the sequence does not
    hold (the padding block, its last block's tail) and in every block wholly behind the first query's
    window, so that reading any of them would show."""
    gen = torch.Generator().manual_seed(head_dim + block_size + group + context + new)
    total = context + new
    width = -(-total // block_size)
    num_blocks = width + 1
    shape = (KV_HEADS, num_blocks, block_size, head_dim)
    caches = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    table = block_tables([total], width, block_size, num_blocks, gen)[0]
    q = torch.randn(new, KV_HEADS * group, head_dim, generator=gen) * 1.5
    scale = head_dim**-0.5
    expected = reference_attention(
        q, cached(caches[0], table, total), cached(caches[1], table, total), scale, window
    )
    poison_unused(caches, table[None], [total], float("nan"))
    if window is not None:
        for cache in caches:
            cache[:, table[: max(0, context - window + 1) // block_size]] = float("nan")

    actual = native.prefill_attention(q, *caches, table, context, scale, window)

    vector = 16 if isa.startswith("avx512") else 8 if isa == "avx2" else 4
    assert (actual is None) == (head_dim % vector != 0)
    if actual is None:
        return
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("head_dim", "block_size", "group", "context", "new", "window"), PREFILL_CASES)
def test_native_prefill_reads_bf16_caches_as_their_fp32_values(
    isa: str, head_dim: int, block_size: int, group: int, context: int, new: int, window: int | None
) -> None:
    """`--dtype bfloat16`: bf16 queries and caches widen exactly and are computed with in fp32, so the
    output is the fp32 kernel's on the widened values, rounded to bf16 once (fp32 queries, under
    `--kv-cache-dtype bfloat16`: unrounded); the slots it must not read (the sequence's padding, the
    blocks wholly behind the first query's window) hold NaN in bf16 too."""
    gen = torch.Generator().manual_seed(head_dim * block_size + group + context + new)
    total = context + new
    width = -(-total // block_size)
    shape = (KV_HEADS, width + 1, block_size, head_dim)
    caches = torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16()
    table = block_tables([total], width, block_size, width + 1, gen)[0]
    q = (torch.randn(new, KV_HEADS * group, head_dim, generator=gen) * 1.5).bfloat16()
    scale = head_dim**-0.5
    poison_unused(caches, table[None], [total], float("nan"))
    if window is not None:
        for cache in caches:
            cache[:, table[: max(0, context - window + 1) // block_size]] = float("nan")

    actual = native.prefill_attention(q, *caches, table, context, scale, window)
    widened = native.prefill_attention(
        q.float(), caches[0].float(), caches[1].float(), table, context, scale, window
    )

    if head_dim % (16 if isa.startswith("avx512") else 8 if isa == "avx2" else 4):
        assert actual is None and widened is None
        return
    assert actual is not None and widened is not None
    assert actual.dtype == torch.bfloat16
    assert torch.equal(actual, widened.bfloat16())
    mixed = native.prefill_attention(q.float(), *caches, table, context, scale, window)
    assert mixed is not None and torch.equal(mixed, widened)


def test_native_prefill_refuses_a_table_short_of_the_last_query() -> None:
    cache = torch.zeros(KV_HEADS, 4, 16, 64)
    with pytest.raises(ValueError, match="does not cover"):
        native.prefill_attention(torch.zeros(20, KV_HEADS, 64), cache, cache, torch.tensor([0]), 0, 1.0)
    with pytest.raises(ValueError, match="outside"):
        native.prefill_attention(torch.zeros(2, KV_HEADS, 64), cache, cache, torch.tensor([4]), 0, 1.0)


def slots_of(table: torch.Tensor, start: int, stop: int, block_size: int) -> torch.Tensor:
    t = torch.arange(start, stop)
    return table[t // block_size] * block_size + t % block_size


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("head_dim", "group"), [(64, 1), (80, 3), (128, 8), (36, 2)])
def test_ragged_batch_equals_fp64_attention(
    head_dim: int, group: int, native: bool, cache_dtype: torch.dtype
) -> None:
    """Two decodes, a fresh prefill, and a chunk starting mid-sequence (45 tokens cached, mid-block),
    in one flat batch as the model runner lays it out: each token's K and V land in its slot, and each
    output attends to its own sequence up to its own position; through the C kernels (where the
    prefill kernel's vectors do not divide head_dim, 36 on AVX-512, PyTorch's SDPA instead), or
    PyTorch's. With a bf16 cache under fp32 queries (`--kv-cache-dtype bfloat16`) every path attends to
    the keys and values as the cache holds them, rounded, the new ones too."""
    block_size, width = 16, 8
    gen = torch.Generator().manual_seed(head_dim + group)
    decode_lens, fresh_len, context, chunk_len = [17, 1], 23, 45, 30
    totals = [*decode_lens, fresh_len, context + chunk_len]
    num_blocks = len(totals) * width + 1
    heads = KV_HEADS * group
    shape = (KV_HEADS, num_blocks, block_size, head_dim)
    caches = (
        torch.randn(shape, generator=gen).to(cache_dtype),
        torch.randn(shape, generator=gen).to(cache_dtype),
    )
    tables = block_tables(totals, width, block_size, num_blocks, gen)
    # The new tokens: each decode's last, the whole fresh prefill, the chunk after its context.
    news = [(n - 1, n) for n in decode_lens] + [(0, fresh_len), (context, context + chunk_len)]
    num_tokens = sum(stop - start for start, stop in news)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen) * 1.5
    k = torch.randn(num_tokens, KV_HEADS, head_dim, generator=gen)
    v = torch.randn(num_tokens, KV_HEADS, head_dim, generator=gen)
    slots = torch.cat([slots_of(table, *new, block_size) for table, new in zip(tables, news)])
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decodes=2,
        decode_block_tables=tables[:2],
        decode_seq_lens=torch.tensor(decode_lens),
        decode_max_len=max(decode_lens),
        prefills=[
            PrefillChunk(2, fresh_len, 0, tables[2]),
            PrefillChunk(2 + fresh_len, chunk_len, context, tables[3]),
        ],
        native_decode=native,
        native_prefill=native,
    )
    scale = head_dim**-0.5
    expected, start = [], 0
    for table, (first, total) in zip(tables, news):
        rows = slice(start, start + total - first)
        # What the sequence holds once this step's tokens are in: the cached ones, then the new ones.
        keys = torch.cat([cached(caches[0], table, first), k[rows].to(cache_dtype)]).float()
        values = torch.cat([cached(caches[1], table, first), v[rows].to(cache_dtype)]).float()
        expected.append(reference_attention(q[rows], keys, values, scale))
        start = rows.stop
    poison_unused(caches, tables, totals, float("nan") if native else 1e4)

    out = paged_attention(q, k, v, *caches, meta, scale)

    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), torch.cat(expected), rtol=1e-5, atol=1e-5)
    for cache, new in zip(caches, (k, v)):
        assert torch.equal(cache.view(KV_HEADS, -1, head_dim)[:, slots].transpose(0, 1), new.to(cache_dtype))


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    assert native.cache_dir() == tmp_path / "llmserve" / "kernels"
