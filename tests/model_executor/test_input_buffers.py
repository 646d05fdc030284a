"""The persistent step inputs: rows written in place, grown on demand, earlier rows' values never leak."""

from __future__ import annotations

import torch

from llmserve.model_executor.input_buffers import InputBuffers


def test_rows_hold_ids_positions_and_slots_of_each_request() -> None:
    buffers = InputBuffers(tokens=4, seqs=1, blocks_per_seq=1)
    buffers.reserve(tokens=7, seqs=2, blocks_per_seq=3)  # grows past every initial size
    buffers.write_tokens(0, [11], 5, [7, 2], block_size=4)  # a decode at position 5: block 2, offset 1
    buffers.write_decodes(0, 1, [7, 2], 6)
    buffers.write_tokens(1, [20, 21, 22, 23, 24, 25], 2, [9, 4], block_size=4)  # a prefill chunk
    assert buffers.token_ids[:7].tolist() == [11, 20, 21, 22, 23, 24, 25]
    assert buffers.positions[:7].tolist() == [5, 2, 3, 4, 5, 6, 7]
    assert buffers.slots[:7].tolist() == [9, 38, 39, 16, 17, 18, 19]
    assert buffers.decode_tables[0, :2].tolist() == [7, 2] and buffers.decode_lens[0] == 6


def test_a_shorter_table_reuses_the_row_and_growth_keeps_it_valid() -> None:
    buffers = InputBuffers(tokens=2, seqs=1, blocks_per_seq=2)
    buffers.write_decodes(0, 1, [5, 6], 20)
    buffers.write_decodes(0, 1, [3], 3)
    assert buffers.decode_tables[0].tolist() == [3, 6]  # padding: a block id, masked by the length
    buffers.reserve(tokens=1, seqs=4, blocks_per_seq=5)
    assert buffers.decode_tables.shape[0] >= 4 and buffers.decode_tables.shape[1] >= 5
    assert torch.count_nonzero(buffers.decode_tables) == 0  # fresh rows pad with block 0
