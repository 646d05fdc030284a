"""Checking guessed tokens against the model's own distribution, so that speculation changes no output's
distribution (vLLM's rejection sampling, for guesses made with certainty: n-gram lookup proposes one
token, with probability 1)."""

from __future__ import annotations

import torch


def accept_drafts(
    probs: torch.Tensor, draft_token_ids: torch.Tensor, generators: dict[int, torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [rows, vocab] (a row's sampling distribution p), draft_token_ids [rows] (-1: no guess) →
    (where to sample from instead, which guesses stand).

    A guess d stands with probability p(d); else the row samples from p without d, renormalised
    (argmax(w / E) does not need the weights normalised). Together the row's token is distributed as p,
    and it differs from d exactly when d was rejected. Seeded rows draw from their own generator."""
    has_draft = draft_token_ids >= 0
    drafts = draft_token_ids.clamp(min=0).unsqueeze(1)
    p_draft = probs.gather(1, drafts).squeeze(1)
    uniform = torch.rand(probs.shape[0], device=probs.device)
    for row, generator in generators.items():
        if has_draft[row]:
            uniform[row] = torch.rand((), generator=generator, device=probs.device)
    residual = probs.scatter(1, drafts, 0.0)
    residual = torch.where(has_draft.unsqueeze(1), residual, probs)
    # p(d) = 1 in fp32 may still lose to a uniform draw just below 1: nothing is left to sample then
    accepted = has_draft & ((uniform < p_draft) | (residual.sum(dim=1) == 0))
    return residual, accepted
