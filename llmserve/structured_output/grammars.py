"""A request's `StructuredOutputsParams` as one llguidance grammar, and the front end's check of it.

The front ends (`InputProcessor`, the OpenAI server) call `check` so a broken schema, regex or grammar
is refused before it reaches the engine; the engine core compiles `to_grammar`'s text into a matcher.
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from llmserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Every JSON object, as vLLM's `json_object` (OpenAI's response_format {"type": "json_object"}).
_ANY_OBJECT = '{"type": "object"}'
# An LLTokenizer takes about a second to build from a Hugging Face one: one per front-end tokenizer.
_LL_TOKENIZERS: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
# Grammars already validated, per tokenizer, most recent last: validating builds the lexer (up to
# llguidance's limits), which a request's second and third checks need not repeat.
_VALID_GRAMMARS: weakref.WeakKeyDictionary[Any, OrderedDict[str, None]] = weakref.WeakKeyDictionary()
_MAX_VALID_GRAMMARS = 512
_VALID_LOCK = threading.Lock()


class StructuredOutputError(ValueError):
    """A request's grammar failed in the engine core (it did not compile there, or rejected a token);
    the engine and the other requests go on."""


def to_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) for `params`. Raises `ValueError` when the schema is not
    JSON or the grammar is neither Lark nor GBNF; anything else wrong shows when it is validated."""
    if params.json is not None or params.json_object:
        schema: Any = params.json if params.json is not None else _ANY_OBJECT
        options: JsonCompileOptions = {"whitespace_flexible": False}
        if params.whitespace_pattern is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern}
        try:
            if params.disable_additional_properties:
                schema = _without_additional_properties(
                    json.loads(schema) if isinstance(schema, str) else schema
                )
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:  # json.JSONDecodeError too
            raise ValueError(f"structured_outputs.json is not a valid JSON schema: {e}") from None
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        # An exact alternation: each choice is a Lark string literal (JSON's escapes).
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, params.choice)))
    assert params.grammar is not None
    try:
        lark = any_to_lark(params.grammar)  # Lark as it is; GBNF (llama.cpp's EBNF) converted
    except Exception as e:  # gbnf_to_lark raises its own parse errors
        raise ValueError(f"structured_outputs.grammar is neither Lark nor GBNF: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check(params: StructuredOutputsParams, tokenizer: object) -> None:
    """Raises `ValueError` naming the field and the problem when `params` cannot compile for this
    tokenizer (the front end's Hugging Face tokenizer: special tokens a grammar names must exist)."""
    if params.choice is not None and (
        not params.choice or not all(isinstance(c, str) and c for c in params.choice)
    ):
        raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings.")
    grammar = to_grammar(params)
    with _VALID_LOCK:  # the server checks in a worker thread; the engine's front end again, on its loop
        valid = _VALID_GRAMMARS.setdefault(tokenizer, OrderedDict())
        if grammar in valid:
            valid.move_to_end(grammar)
            return
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer(tokenizer))
    if is_error:
        raise ValueError(f"structured_outputs.{params.kind} is invalid: {messages[0]}")
    with _VALID_LOCK:
        valid[grammar] = None
        if len(valid) > _MAX_VALID_GRAMMARS:
            valid.popitem(last=False)


def ll_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer, built once per tokenizer."""
    ll = _LL_TOKENIZERS.get(tokenizer)
    if ll is None:
        import llguidance.hf  # imports transformers, which the engine core (using to_grammar) need not

        ll = _LL_TOKENIZERS[tokenizer] = llguidance.hf.from_tokenizer(tokenizer)
    return ll


def _without_additional_properties(schema: Any) -> Any:
    """vLLM's `disable_additional_properties`: every object schema that names its properties and says
    nothing of others takes no others."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
            if "additionalProperties" not in node and ("properties" in node or "patternProperties" in node):
                node["additionalProperties"] = False
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema
