"""Hugging Face greedy references, compared with ours under the rule of tests/greedy_match.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmserve import LLM
from llmserve.outputs import CompletionOutput, RequestOutput
from tests.greedy_match import Top2, assert_greedy_match, our_choices_along


@dataclass
class Reference:
    token_ids: list[int]
    logprobs: list[torch.Tensor]  # per generated position, [vocab] log_softmax of fp32 logits
    # The tokens of ours it was forced along (hf_teacher_forced), or None for a sequence of HF's own:
    # then position i's choice and logprobs follow those tokens before i, not token_ids.
    forced_along: list[int] | None = None


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


def assert_matches_hf(llm: LLM, ours: RequestOutput, ref: Reference) -> int | None:
    """The rule of tests/greedy_match.py against a Hugging Face reference; the near-tie's position."""
    completion = ours.outputs[0]

    def top2(i: int) -> Top2:
        values, indices = ref.logprobs[i].topk(2)
        return Top2(int(indices[0]), float(values[0]), int(indices[1]), float(values[1]))

    if ref.forced_along is not None:  # a reference forced along another run proves nothing of this one
        assert list(completion.token_ids) == ref.forced_along, "the reference follows another run's tokens"

    def along() -> list[int]:
        if ref.forced_along is not None:  # its later positions already follow our tokens: compare them
            return ref.forced_along
        return our_choices_along(llm, ours.prompt_token_ids, ref.token_ids)

    return assert_greedy_match(completion.token_ids, ref.token_ids, top2, along)


@torch.no_grad()
def hf_teacher_forced(model: Any, prompt_ids: list[int], generated: list[int]) -> Reference:
    """HF's greedy choice at each position given our tokens so far: one forward pass instead of a
    generate() loop. Up to the first divergence this is exactly HF's greedy continuation."""
    logits = model(torch.tensor([prompt_ids + generated])).logits[0, len(prompt_ids) - 1 : -1]
    logprobs = logits.float().log_softmax(-1)
    return Reference(logprobs.argmax(-1).tolist(), list(logprobs), forced_along=list(generated))


def hf_forced_references(model: Any, outputs: list[RequestOutput], num_tokens: int) -> list[Reference]:
    """hf_teacher_forced along each of our greedy outputs, which must be num_tokens long (a reference
    from generate() would be): one forward pass a prompt where generate() takes one a token (32 tokens
    of Qwen2.5-0.5B: 0.7 s instead of 6). Each reference holds only for the output it was forced along."""
    for out in outputs:
        assert len(out.outputs[0].token_ids) == num_tokens, (out.prompt, out.outputs[0])
    return [hf_teacher_forced(model, out.prompt_token_ids, list(out.outputs[0].token_ids)) for out in outputs]


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
