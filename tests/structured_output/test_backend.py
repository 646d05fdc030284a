"""The llguidance backend and the bitmask on logits, against llguidance's own per-token mask."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured_output.bitmask import GrammarBitmask, apply_grammar_bitmask
from llmserve.structured_output.grammars import to_grammar
from llmserve.structured_output.llguidance_backend import LLGuidanceBackend, LLGuidanceGrammar
from tests.structured_output.conftest import VOCAB_SIZE

EOS = 2  # SmolLM2's <|im_end|>


def compile_(backend: LLGuidanceBackend, **params: Any) -> LLGuidanceGrammar:
    return backend.compile(to_grammar(StructuredOutputsParams(**params)))


def allowed(grammar: LLGuidanceGrammar) -> torch.Tensor:
    """llguidance's own answer: one byte per token, 200 where allowed."""
    bias = torch.frombuffer(bytearray(grammar.matcher.compute_logit_bias()), dtype=torch.uint8)
    return bias[:VOCAB_SIZE] > 0


def test_bitmask_on_logits_masks_exactly_what_each_matcher_forbids(
    backend: LLGuidanceBackend, tokenizer: Any
) -> None:
    grammars = {
        "json": compile_(backend, json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        "regex": compile_(backend, regex="[0-9]{2,4}"),
        "choice": compile_(backend, choice=["yes", "no"]),
    }
    grammars["regex"].accept_tokens(tokenizer.encode("12", add_special_tokens=False))  # may end here
    bitmask = backend.allocate_bitmask(8)
    backend.fill_bitmask(list(grammars.values()), bitmask, [0, 1, 2])
    # a batch of 5 rows, 3 of them constrained, in another order than the bitmask's
    batch_ids = ["free1", "choice", "json", "free2", "regex"]
    logits = torch.randn(5, VOCAB_SIZE)
    before = logits.clone()
    apply_grammar_bitmask(
        logits, batch_ids, GrammarBitmask(list(grammars), [1, 1, 1], bitmask[: len(grammars)])
    )
    for row, request_id in enumerate(batch_ids):
        if request_id.startswith("free"):
            assert torch.equal(logits[row], before[row])
        else:
            expected = allowed(grammars[request_id])
            assert torch.equal(torch.isfinite(logits[row]), expected)
            assert torch.equal(logits[row][expected], before[row][expected])
    assert not allowed(grammars["json"])[EOS]  # incomplete: no EOS
    assert allowed(grammars["regex"])[EOS]  # complete ("12"), yet may go on
    assert allowed(grammars["regex"]).sum() > 1


def test_a_complete_choice_terminates_and_allows_only_eos(backend: LLGuidanceBackend, tokenizer: Any) -> None:
    grammar = compile_(backend, choice=["yes", "no"])
    assert not grammar.is_terminated()
    assert grammar.accept_tokens(tokenizer.encode("yes", add_special_tokens=False))
    assert grammar.is_terminated()
    assert allowed(grammar).nonzero().flatten().tolist() == [EOS]


def test_a_rejected_token_puts_the_grammar_in_error_and_says_why(
    backend: LLGuidanceBackend, tokenizer: Any
) -> None:
    grammar = compile_(backend, regex="[0-9]+")
    assert not grammar.accept_tokens(tokenizer.encode("a", add_special_tokens=False))
    assert grammar.error


def test_rollback_restores_the_mask(backend: LLGuidanceBackend, tokenizer: Any) -> None:
    grammar = compile_(backend, json={"type": "array", "items": {"type": "integer"}})
    start = allowed(grammar)
    tokens = tokenizer.encode("[1,2", add_special_tokens=False)
    assert grammar.accept_tokens(tokens)
    assert not torch.equal(allowed(grammar), start)
    grammar.rollback(len(tokens))
    assert torch.equal(allowed(grammar), start)


def test_a_grammar_that_does_not_compile_raises_value_error(backend: LLGuidanceBackend) -> None:
    with pytest.raises(ValueError, match="unclosed character class"):
        compile_(backend, regex="[a-")
