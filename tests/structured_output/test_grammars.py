"""`to_grammar` / `check`: what each kind of `StructuredOutputsParams` accepts, on SmolLM2's tokenizer."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from llmserve.config import StructuredOutputsConfig
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured_output import grammars
from llmserve.structured_output.grammars import check, check_async, to_grammar
from llmserve.structured_output.llguidance_backend import LLGuidanceBackend

LIMITS = StructuredOutputsConfig()
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def accepts(backend: LLGuidanceBackend, tokenizer: Any, params: StructuredOutputsParams, text: str) -> bool:
    """Whether `text` is a complete output under `params` (tokenized as the model would write it)."""
    grammar = backend.compile(to_grammar(params))
    ok = grammar.accept_tokens(tokenizer.encode(text, add_special_tokens=False))
    return ok and grammar.matcher.is_accepting()  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize(
    ("params", "text", "expected"),
    [
        (StructuredOutputsParams(json=PERSON), '{"name":"Ann","age":3}', True),
        (StructuredOutputsParams(json=PERSON), '{"name": "Ann", "age": 3}', False),  # compact by default
        (StructuredOutputsParams(json=PERSON), '{"name":"Ann"}', False),  # required
        (StructuredOutputsParams(json=PERSON), '{"name":"Ann","age":3,"x":1}', False),  # closed by default
        (
            StructuredOutputsParams(json=PERSON, disable_additional_properties=False),
            '{"name":"Ann","age":3,"x":1}',
            True,
        ),
        (StructuredOutputsParams(json=PERSON, whitespace_pattern=" ?"), '{"name": "Ann", "age": 3}', True),
        (StructuredOutputsParams(json='{"type": "integer"}'), "12", True),  # a schema as text
        (StructuredOutputsParams(json_object=True), '{"a":[1,{"b":null}]}', True),
        (StructuredOutputsParams(json_object=True), "[1]", False),
        (StructuredOutputsParams(regex=r"\d{3}-[a-z]+"), "123-abc", True),
        (StructuredOutputsParams(regex=r"\d{3}-[a-z]+"), "12-abc", False),
        (StructuredOutputsParams(choice=["yes", "no", 'say "hi"']), "no", True),
        (StructuredOutputsParams(choice=["yes", "no", 'say "hi"']), 'say "hi"', True),
        (StructuredOutputsParams(choice=["yes", "no"]), "ye", False),
        (StructuredOutputsParams(choice=["yes", "no"]), "yes no", False),
        (StructuredOutputsParams(grammar='start: "a" b+\nb: "b" | "c"'), "abcb", True),  # Lark
        (StructuredOutputsParams(grammar='start: "a" b+\nb: "b" | "c"'), "ad", False),
        (StructuredOutputsParams(grammar='root ::= "x" [0-9]+'), "x42", True),  # GBNF
        (StructuredOutputsParams(grammar='root ::= "x" [0-9]+'), "y42", False),
    ],
)
def test_each_kind_accepts_exactly_its_language(
    backend: LLGuidanceBackend, tokenizer: Any, params: StructuredOutputsParams, text: str, expected: bool
) -> None:
    assert accepts(backend, tokenizer, params, text) == expected


@pytest.mark.parametrize(
    ("params", "field", "problem"),
    [
        (StructuredOutputsParams(json={"type": "nonsense"}), "json", "nonsense"),
        (StructuredOutputsParams(json="{not json"), "json", "not a valid JSON schema"),
        (StructuredOutputsParams(regex="[a-"), "regex", "unclosed character class"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar", "undefined_rule"),
        (StructuredOutputsParams(grammar="start: <|no_such_token|>"), "grammar", "no_such_token"),
        (StructuredOutputsParams(choice=["a", ""]), "choice", "non-empty"),
    ],
)
def test_check_names_the_field_and_the_problem(
    tokenizer: Any, params: StructuredOutputsParams, field: str, problem: str
) -> None:
    with pytest.raises(ValueError, match=f"structured_outputs.{field}") as e:
        check(params, tokenizer, LIMITS)
    assert problem in str(e.value)


def test_check_passes_valid_params_and_special_tokens_the_tokenizer_has(tokenizer: Any) -> None:
    check(StructuredOutputsParams(json=PERSON), tokenizer, LIMITS)
    check(StructuredOutputsParams(grammar='start: "done" <|im_end|>'), tokenizer, LIMITS)


def test_a_validation_past_the_timeout_fails_alone_and_a_later_one_passes(tokenizer: Any) -> None:
    """Validation runs on a grammar thread; the caller gives up after grammar_timeout with a ValueError
    naming the field and the flag. The heavy one (a wide choice, validated for about as long as its width)
    finishes in the background without holding the next check up for good."""
    heavy = StructuredOutputsParams(choice=[f"timeout-{i}-{uuid.uuid4().hex}" for i in range(20_000)])
    limits = StructuredOutputsConfig(max_grammar_alternatives=20_000, grammar_timeout=0.05)
    with pytest.raises(
        ValueError, match=r"structured_outputs.choice took longer than 0.05 s.*--grammar-timeout"
    ):
        check(heavy, tokenizer, limits)
    with pytest.raises(ValueError, match="took longer"):
        asyncio.run(check_async(heavy, tokenizer, limits))
    check(StructuredOutputsParams(regex="[0-9]+"), tokenizer, LIMITS)


def test_check_async_refuses_past_the_limits_and_passes_the_rest(tokenizer: Any) -> None:
    deep = StructuredOutputsParams(regex="(" * 500 + "a" + ")" * 500)
    with pytest.raises(ValueError, match="--max-grammar-depth"):
        asyncio.run(check_async(deep, tokenizer, LIMITS))
    with pytest.raises(ValueError, match="unclosed character class"):
        asyncio.run(check_async(StructuredOutputsParams(regex="[a-"), tokenizer, LIMITS))
    asyncio.run(check_async(StructuredOutputsParams(json=PERSON), tokenizer, LIMITS))


def test_params_that_passed_are_checked_again_for_the_cost_of_a_hash(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server checks a constraint off its shared threads first; the checks as the request is
    prepared and submitted must then do no limits walk, conversion or validation there."""
    params = StructuredOutputsParams(json={**PERSON, "title": uuid.uuid4().hex})
    asyncio.run(check_async(params, tokenizer, LIMITS))

    def fail(*_: object) -> None:
        raise AssertionError("checked again")

    monkeypatch.setattr(grammars, "_bounded_grammar", fail)
    check(StructuredOutputsParams(json=dict(params.json)), tokenizer, LIMITS)  # type: ignore[arg-type]
    with pytest.raises(AssertionError):  # other limits: not the same check
        check(params, tokenizer, StructuredOutputsConfig(max_grammar_depth=3))
