"""A step's flat inputs, written in place into tensors that live as long as the model runner.

Each step fills the first rows through NumPy views (a request's token ids as one slice assignment, its
positions and slots as array arithmetic: no Python loop over tokens, no tensor built per step) and hands
the model views of those rows. The buffers grow when a step needs more rows or blocks, never shrink.
"""

from __future__ import annotations

import numpy as np
import torch


class InputBuffers:
    def __init__(self, tokens: int = 256, seqs: int = 16, blocks_per_seq: int = 16) -> None:
        self.token_ids = torch.zeros(tokens, dtype=torch.int64)
        self.positions = torch.zeros(tokens, dtype=torch.int64)
        self.slots = torch.zeros(tokens, dtype=torch.int64)  # flat KV cache slot of each token
        # Decode rows: block tables padded with block 0 (a valid id, masked out), and lengths.
        self.decode_tables = torch.zeros(seqs, blocks_per_seq, dtype=torch.int64)
        self.decode_lens = torch.zeros(seqs, dtype=torch.int64)

    def reserve(self, tokens: int, seqs: int, blocks_per_seq: int) -> None:
        """Room for a step of this many tokens, decode rows and blocks per decode row."""
        if tokens > len(self.token_ids):
            size = max(tokens, 2 * len(self.token_ids))
            self.token_ids, self.positions, self.slots = (
                torch.zeros(size, dtype=torch.int64) for _ in range(3)
            )
        rows, width = self.decode_tables.shape
        if seqs > rows or blocks_per_seq > width:
            rows, width = max(seqs, rows), max(blocks_per_seq, 2 * width if blocks_per_seq > width else width)
            self.decode_tables = torch.zeros(rows, width, dtype=torch.int64)
            self.decode_lens = torch.zeros(rows, dtype=torch.int64)

    def write_tokens(
        self, at: int, token_ids: list[int], start: int, block_ids: list[int], block_size: int
    ) -> None:
        """A request's tokens at positions [start, start + len(token_ids)) into rows [at, ...)."""
        n = len(token_ids)
        self.token_ids.numpy()[at : at + n] = token_ids
        positions = np.arange(start, start + n)
        self.positions.numpy()[at : at + n] = positions
        table = np.asarray(block_ids, dtype=np.int64)
        self.slots.numpy()[at : at + n] = table[positions // block_size] * block_size + positions % block_size

    def write_decodes(self, row: int, count: int, block_ids: list[int], seq_len: int) -> None:
        """`count` decode rows of one sequence from `row`, of lengths seq_len, seq_len + 1, ..."""
        self.decode_tables.numpy()[row : row + count, : len(block_ids)] = block_ids
        self.decode_lens.numpy()[row : row + count] = np.arange(seq_len, seq_len + count)
