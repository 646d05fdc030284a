"""Hugging Face greedy references, and the near-tie rule for comparing token sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmserve.outputs import CompletionOutput

TIE_TOLERANCE = 1e-3


@dataclass
class Reference:
    token_ids: list[int]
    logprobs: list[torch.Tensor]  # per generated position, [vocab] log_softmax of fp32 logits


@torch.no_grad()
def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> Reference:
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        # Explicit, or HF infers one from pad_token_id and masks the prompt's own <|im_end|> tokens.
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ids = out.sequences[0, len(prompt_ids) :].tolist()
    return Reference(ids, [step[0].float().log_softmax(-1) for step in out.logits])


def compare_greedy(ours: CompletionOutput, ref: Reference) -> str | None:
    """None when the token ids are equal; a note when they first differ at a near-tie (both tokens in
    the other side's top 2, their logprobs within 1e-3 on both sides); AssertionError otherwise.
    `ours` must carry logprobs with k >= 2.
    """
    for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)):
        if a == b:
            continue
        assert ours.logprobs is not None
        our_top = {t: lp.logprob for t, lp in ours.logprobs[i].items() if (lp.rank or 3) <= 2}
        ref_lp = ref.logprobs[i]
        ref_top2 = ref_lp.topk(2).indices.tolist()
        tie = (
            a in ref_top2
            and b in our_top
            and a in our_top
            and abs(float(ref_lp[a] - ref_lp[b])) < TIE_TOLERANCE
            and abs(our_top[a] - our_top[b]) < TIE_TOLERANCE
        )
        assert tie, (
            f"token {i} differs: ours {a}, HF {b}; HF logprobs {float(ref_lp[a]):.5f} vs "
            f"{float(ref_lp[b]):.5f}; our top 2 {our_top}"
        )
        return f"near-tie at token {i}: ours {a}, HF {b}"
    assert len(ours.token_ids) == len(ref.token_ids)
    return None


@torch.no_grad()
def hf_teacher_forced(model: Any, prompt_ids: list[int], generated: list[int]) -> Reference:
    """HF's greedy choice at each position given our tokens so far: one forward pass instead of a
    generate() loop. Up to the first divergence this is exactly HF's greedy continuation."""
    logits = model(torch.tensor([prompt_ids + generated])).logits[0, len(prompt_ids) - 1 : -1]
    logprobs = logits.float().log_softmax(-1)
    return Reference(logprobs.argmax(-1).tolist(), list(logprobs))


def assert_top_logprobs_match(
    ours: CompletionOutput, ref: Reference, k: int, tolerance: float = 1e-3
) -> None:
    """At each position before the sequences part, our top-k tokens are HF's top-k, each logprob within
    `tolerance` of HF's for the same token; two tokens may swap ranks only where their logprobs are that
    close (a near-tie in the last place swaps which token is k-th)."""
    assert ours.logprobs is not None
    for position, (entry, ref_lp) in enumerate(zip(ours.logprobs, ref.logprobs)):
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k)
        assert len(ranked) == k
        kth = float(ref_lp.topk(k).values[-1])
        for _, token in ranked:
            theirs = float(ref_lp[token])
            assert abs(entry[token].logprob - theirs) < tolerance, (position, token, entry[token], theirs)
            assert theirs > kth - tolerance, f"position {position}: {token} is not in HF's top {k}"
        if position + 1 < len(ours.token_ids) and ours.token_ids[position] != ref.token_ids[position]:
            return
