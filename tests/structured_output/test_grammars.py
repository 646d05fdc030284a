"""`to_grammar` / `check`: what each kind of `StructuredOutputsParams` accepts, on SmolLM2's tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured_output.grammars import check, to_grammar
from llmserve.structured_output.llguidance_backend import LLGuidanceBackend

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
        check(params, tokenizer)
    assert problem in str(e.value)


def test_check_passes_valid_params_and_special_tokens_the_tokenizer_has(tokenizer: Any) -> None:
    check(StructuredOutputsParams(json=PERSON), tokenizer)
    check(StructuredOutputsParams(grammar='start: "done" <|im_end|>'), tokenizer)
