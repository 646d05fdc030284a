"""Our C decode kernel against the PyTorch decode path it replaces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmserve.model_executor.attention import AttentionMetadata, _decode_attention
from llmserve.model_executor.kernels import native

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no C compiler here")


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "block_size", "max_blocks"),
    [(1, 4, 4, 16, 1), (5, 9, 3, 16, 7), (16, 8, 2, 4, 13), (3, 6, 1, 8, 5)],
)
def test_native_decode_matches_torch(
    batch: int, heads: int, kv_heads: int, block_size: int, max_blocks: int
) -> None:
    gen = torch.Generator().manual_seed(batch * 100 + heads)
    head_dim, num_blocks = 32, 64
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    # Scattered blocks, ragged lengths from 1 token to full tables; unused table entries padded with 0.
    lens = torch.randint(1, max_blocks * block_size + 1, (batch,), generator=gen)
    lens[0] = 1
    lens[-1] = max_blocks * block_size
    tables = torch.zeros(batch, max_blocks, dtype=torch.int64)
    for row, length in enumerate(lens.tolist()):
        used = -(-length // block_size)
        tables[row, :used] = torch.randperm(num_blocks, generator=gen)[:used]
    q = torch.randn(batch, heads, head_dim, generator=gen)
    meta = AttentionMetadata(torch.zeros(1, dtype=torch.int64), batch, tables, lens, int(lens.max()), [])

    expected = _decode_attention(q, k_cache, v_cache, meta, 0.17)
    actual = native.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.17)

    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_native_decode_reads_only_the_sequence_blocks() -> None:
    """Poisoned blocks outside a sequence's table (and past its length) never reach its output."""
    k_cache = torch.randn(1, 4, 4, 8)
    v_cache = torch.randn(1, 4, 4, 8)
    k_cache[:, 2:] = float("nan")
    v_cache[:, 2:] = float("nan")
    k_cache[:, 1, 2:] = float("nan")  # past the length: slots 6 and 7 of the sequence
    tables = torch.tensor([[0, 1]])
    q = torch.randn(1, 2, 8)
    out = native.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([6]), 0.3)
    assert torch.isfinite(out).all()


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    assert native.cache_dir() == tmp_path / "llmserve" / "kernels"
