"""A request's `StructuredOutputsParams` as one llguidance grammar, and the front end's check of it.

The front ends (`InputProcessor`, the OpenAI server) call `check` (the server `check_async` first) so a
schema, regex or grammar past the limits, or broken, is refused before it reaches the engine; the engine
core compiles `to_grammar`'s text into a matcher.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance
import msgspec
from llguidance.gbnf_to_lark import any_to_lark

from llmserve.config import StructuredOutputsConfig
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured_output.grammar_threads import LargeStackExecutor
from llmserve.structured_output.limits import check_limits

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Every JSON object, as vLLM's `json_object` (OpenAI's response_format {"type": "json_object"}).
_ANY_OBJECT = '{"type": "object"}'
# An LLTokenizer takes about a second to build from a Hugging Face one: one per front-end tokenizer.
_LL_TOKENIZERS: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_LL_TOKENIZERS_LOCK = threading.Lock()
# Digests of the params that passed, per tokenizer, most recent last: a request's constraint is checked
# again as it is prepared and submitted, which must then cost no limits walk, conversion or validation.
# Digests, not grammars: the memory stays small while the count stays large enough that no client can
# push a request's entry out between its checks.
_PASSED: weakref.WeakKeyDictionary[Any, OrderedDict[bytes, None]] = weakref.WeakKeyDictionary()
_MAX_PASSED = 1 << 16
_PASSED_LOCK = threading.Lock()


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
        except (ValueError, RecursionError) as e:  # json.JSONDecodeError too
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


def check(params: StructuredOutputsParams, tokenizer: object, limits: StructuredOutputsConfig) -> None:
    """Raises `ValueError` naming the field and the problem when `params` is past `limits` or cannot
    compile for this tokenizer (the front end's Hugging Face tokenizer: special tokens a grammar names
    must exist). Params that passed before (under the same limits) cost one hash of their encoding;
    others are checked against the limits here, then validated on a grammar thread, waited for up to
    `limits.grammar_timeout`."""
    key = _key(params, limits)
    if _passed(tokenizer, key):
        return
    grammar = _bounded_grammar(params, limits)
    future = _grammar_threads().submit(_validate, params.kind, grammar, tokenizer, key)
    try:
        future.result(limits.grammar_timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise _timed_out(params, limits) from None


async def check_async(
    params: StructuredOutputsParams, tokenizer: object, limits: StructuredOutputsConfig
) -> None:
    """`check`, all of it on a grammar thread: the caller's thread (the server's event loop, or the one
    that prepares every request) never waits on one request's grammar. Params that pass are
    remembered, so that `check` on them afterwards costs one hash."""
    future = _grammar_threads().submit(_check_here, params, tokenizer, limits)
    try:
        await asyncio.wait_for(asyncio.wrap_future(future), limits.grammar_timeout)
    except TimeoutError:
        raise _timed_out(params, limits) from None


def prepare(tokenizer: object) -> None:
    """Builds llguidance's view of `tokenizer` on a grammar thread now, so that the first structured
    request does not wait for it (or make others wait)."""
    _grammar_threads().submit(ll_tokenizer, tokenizer)


def _check_here(params: StructuredOutputsParams, tokenizer: object, limits: StructuredOutputsConfig) -> None:
    key = _key(params, limits)
    if not _passed(tokenizer, key):
        _validate(params.kind, _bounded_grammar(params, limits), tokenizer, key)


def _bounded_grammar(params: StructuredOutputsParams, limits: StructuredOutputsConfig) -> str:
    """`to_grammar`'s text, once `params` is within `limits` (before any recursive parser sees it)."""
    if params.choice is not None and (
        not params.choice or not all(isinstance(c, str) and c for c in params.choice)
    ):
        raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings.")
    check_limits(params, limits)
    return to_grammar(params)


def _key(params: StructuredOutputsParams, limits: StructuredOutputsConfig) -> bytes | None:
    """A digest of the params and the limits they were checked under; None for params too deep to
    encode (the limits refuse them)."""
    try:
        encoded = msgspec.msgpack.encode(params)
    except RecursionError:
        return None
    return hashlib.sha256(encoded + repr(limits).encode()).digest()


def _passed(tokenizer: object, key: bytes | None) -> bool:
    with _PASSED_LOCK:  # grammar threads add; the server's threads and the engine's front end look up
        passed = _PASSED.setdefault(tokenizer, OrderedDict())
        if key is not None and key in passed:
            passed.move_to_end(key)
            return True
    return False


def _validate(kind: str, grammar: str, tokenizer: object, key: bytes | None) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer(tokenizer))
    if is_error:
        raise ValueError(f"structured_outputs.{kind} is invalid: {messages[0]}")
    if key is not None:
        with _PASSED_LOCK:
            passed = _PASSED.setdefault(tokenizer, OrderedDict())
            passed[key] = None
            if len(passed) > _MAX_PASSED:
                passed.popitem(last=False)


def _timed_out(params: StructuredOutputsParams, limits: StructuredOutputsConfig) -> ValueError:
    return ValueError(
        f"structured_outputs.{params.kind} took longer than {limits.grammar_timeout:g} s to validate "
        "(--grammar-timeout): simplify it."
    )


@functools.cache
def _grammar_threads() -> LargeStackExecutor:
    """Two: one heavy grammar leaves the other for the rest."""
    return LargeStackExecutor(2, "llmserve-grammar")


def ll_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer, built once per tokenizer."""
    with _LL_TOKENIZERS_LOCK:
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
