"""One step's grammar bitmask, from the manager to the model runner, and its application to logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GrammarBitmask:
    """The rows of `bitmask` (int32 `[rows, words]`, on the CPU) hold, request after request, the
    tokens each of `request_ids` may sample at each of its `num_rows` sampled rows this step (more than
    one where it has guesses: row j is the grammar's state after the first j guesses). Only requests
    that sample this step and have a grammar are here."""

    request_ids: list[str]
    num_rows: list[int]
    bitmask: torch.Tensor


# Row b: the 8 bits of byte b, lowest first (a little-endian int32 word is its 4 bytes, lowest first).
_BYTE_BITS = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1 == 1  # [256, 8] bool


def apply_grammar_bitmask(logits: torch.Tensor, row_ids: list[str], grammar: GrammarBitmask) -> None:
    """logits [rows, vocab], row i a sampled row of request `row_ids[i]` (a request's rows in a run):
    set every token a grammar forbids to -inf, in place. The bits are unpacked by one table lookup per
    byte, on any device (llguidance's own helper needs torch.compile, a C compiler and seconds of
    compiling on the CPU)."""
    first_row: dict[str, int] = {}
    for row, request_id in enumerate(row_ids):
        first_row.setdefault(request_id, row)
    starts = [first_row[r] for r in grammar.request_ids]
    rows = torch.tensor(
        [start + j for start, n in zip(starts, grammar.num_rows) for j in range(n)], device=logits.device
    )
    data = grammar.bitmask.to(logits.device, non_blocking=True).view(torch.uint8)  # [k, 4 * words]
    bits = _BYTE_BITS.to(logits.device).index_select(0, data.flatten().long())  # [k * 4 * words, 8]
    allowed = bits.view(len(rows), -1)[:, : logits.shape[-1]]  # [k, vocab]
    logits[rows] = torch.where(allowed, logits[rows], float("-inf"))
