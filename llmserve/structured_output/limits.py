"""Bounds on a request's grammar, checked in Python before llguidance sees it.

llguidance validates and compiles recursively, once per level of a schema or grammar, so a deep enough
one overflows the thread's stack and takes the whole process down; a huge alternation compiles for a
minute. Every walk here is iterative and linear in the grammar's size, so the checks themselves cannot
overflow a stack or take long. Each refusal is a `GrammarLimitError` naming the field and the limit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from llmserve.config import StructuredOutputsConfig
from llmserve.sampling_params import StructuredOutputsParams


class GrammarLimitError(ValueError):
    """A grammar past one of `StructuredOutputsConfig`'s limits; the message names the field and flag."""


def check_limits(params: StructuredOutputsParams, limits: StructuredOutputsConfig) -> None:
    """Raises `GrammarLimitError` when `params` is larger, deeper or wider than `limits` allow."""
    field = f"structured_outputs.{params.kind}"
    if params.json is not None:
        schema = params.json
        if isinstance(schema, str):
            _check_bytes(len(schema.encode("utf-8", "surrogatepass")), field, limits)
            _check_depth(_json_text_depth(schema), field, limits)
            try:
                schema = json.loads(schema)
            except ValueError:
                return  # not JSON: `to_grammar` says so
            _check_schema(schema, field, limits)
        else:
            _check_schema(schema, field, limits)  # first: serializing recurses per level
            _check_bytes(len(json.dumps(schema).encode("utf-8", "surrogatepass")), field, limits)
    elif params.regex is not None:
        _check_bytes(len(params.regex.encode("utf-8", "surrogatepass")), field, limits)
        _check_regex(params.regex, field, limits)
    elif params.choice is not None:
        _check_alternatives(len(params.choice), field, limits)
        _check_bytes(sum(len(c.encode("utf-8", "surrogatepass")) for c in params.choice), field, limits)
    elif params.grammar is not None:
        _check_bytes(len(params.grammar.encode("utf-8", "surrogatepass")), field, limits)
        # GBNF's rules and nesting look the same to these counts as Lark's
        _check_lark(params.grammar, field, limits)
    if params.whitespace_pattern is not None:
        _check_regex(params.whitespace_pattern, "structured_outputs.whitespace_pattern", limits)


def _check_bytes(size: int, field: str, limits: StructuredOutputsConfig) -> None:
    if size > limits.max_grammar_bytes:
        raise GrammarLimitError(
            f"{field} is {size} bytes long, more than the server's limit of {limits.max_grammar_bytes} "
            "(--max-grammar-bytes)."
        )


def _check_depth(depth: int, field: str, limits: StructuredOutputsConfig) -> None:
    if depth > limits.max_grammar_depth:
        raise GrammarLimitError(
            f"{field} nests more than {limits.max_grammar_depth} levels deep (--max-grammar-depth)."
        )


def _check_alternatives(count: int, field: str, limits: StructuredOutputsConfig) -> None:
    if count > limits.max_grammar_alternatives:
        raise GrammarLimitError(
            f"{field} has {count} alternatives in one place, more than the server's limit of "
            f"{limits.max_grammar_alternatives} (--max-grammar-alternatives)."
        )


# --- JSON schemas ---------------------------------------------------------------------------------

_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


def _json_text_depth(text: str) -> int:
    """How deeply the JSON `text` nests, without parsing it (the parser recurses per level)."""
    depth = deepest = 0
    for match in _BRACKETS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


# Keywords whose value is a list of alternative subschemas, or of allowed values.
_ALTERNATIVE_KEYS = ("anyOf", "oneOf", "allOf", "enum", "prefixItems")


def _check_schema(schema: Any, field: str, limits: StructuredOutputsConfig) -> None:
    """Depth counts each object and array of the schema, and goes on through each local `$ref` into
    its target (a `$ref` chain nests as deep as the schemas it links), as a compiler expanding the
    schema would; a `$ref` back into its own chain is recursion, which the grammar keeps as a rule."""

    def walk(pointer: str) -> tuple[int, list[tuple[int, str]]]:
        root = _resolve(schema, pointer)
        deepest, refs = 0, []
        stack: list[tuple[Any, int]] = [(root, 1)]
        while stack:
            node, depth = stack.pop()
            if isinstance(node, dict):
                deepest = max(deepest, depth)
                _check_depth(deepest, field, limits)
                ref = node.get("$ref")
                if isinstance(ref, str) and ref.startswith("#"):
                    refs.append((depth, ref[1:]))
                for key in _ALTERNATIVE_KEYS:
                    if isinstance(node.get(key), list):
                        _check_alternatives(len(node[key]), field, limits)
                stack.extend((child, depth + 1) for child in node.values())
            elif isinstance(node, list):
                deepest = max(deepest, depth)
                _check_depth(deepest, field, limits)
                stack.extend((child, depth + 1) for child in node)
        return deepest, refs

    depth = _longest_chain("", walk)
    _check_depth(depth, field, limits)


def _resolve(schema: Any, pointer: str) -> Any:
    """The node a JSON pointer ("/$defs/a") names; None where it names nothing."""
    node = schema
    for part in pointer.split("/")[1:] if pointer else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _longest_chain(start: Hashable, walk: Callable[[Any], tuple[int, Iterable[tuple[int, Any]]]]) -> int:
    """The deepest nesting from `start` through references: `walk(unit)` gives the unit's own depth and
    its references as (depth at the reference, unit referred to). Each unit is walked once (a DAG of
    references costs its size, not its number of paths); a reference back into the current chain adds
    nothing. Iterative: chains of any length."""
    done: dict[Any, int] = {}
    on_chain: set[Any] = set()
    own, refs = walk(start)
    stack: list[tuple[Any, int, list[tuple[int, Any]]]] = [(start, own, list(refs))]
    on_chain.add(start)
    while stack:
        unit, deepest, pending = stack[-1]
        if pending:
            depth, target = pending.pop()
            if target in done:
                stack[-1] = (unit, max(deepest, depth + done[target]), pending)
            elif target not in on_chain:
                on_chain.add(target)
                target_own, target_refs = walk(target)
                stack.append((target, target_own, list(target_refs)))
                # the parent's depth at this reference is added once the target is done
                stack[-2][2].append((depth, target))
            continue
        stack.pop()
        on_chain.discard(unit)
        done[unit] = deepest
    return done[start]


# --- regular expressions and Lark / GBNF grammars ----------------------------------------------------

_REGEX_TOKENS = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|[()|]", re.DOTALL)


def _regex_shape(regex: str) -> tuple[int, int]:
    """(group nesting depth, the most alternatives of one group or of the whole) of a regex."""
    depth = deepest = 0
    counts = [1]
    widest = 1
    for match in _REGEX_TOKENS.finditer(regex):
        token = match.group()
        if token == "(":
            depth += 1
            deepest = max(deepest, depth)
            counts.append(1)
        elif token == ")" and len(counts) > 1:
            depth -= 1
            widest = max(widest, counts.pop())
        elif token == "|":
            counts[-1] += 1
    return deepest, max(widest, *counts)


def _check_regex(regex: str, field: str, limits: StructuredOutputsConfig) -> None:
    depth, alternatives = _regex_shape(regex)
    _check_depth(depth, field, limits)
    _check_alternatives(alternatives, field, limits)


# A definition starts a line: `name:`, `?name:`, `name.2:`, `NAME:` (Lark) or `name ::=` (GBNF).
_DEFINITION = re.compile(r"^[ \t]*\??([A-Za-z_][\w-]*)(?:\.-?\d+)?[ \t]*(?::(?![:=])|::=)", re.MULTILINE)
_LARK_TOKENS = re.compile(
    r"//[^\n]*|#[^\n]*|\"(?:[^\"\\\n]|\\.)*\"i?|'(?:[^'\\\n]|\\.)*'|/(?:[^/\\\n]|\\.)+/[imslux]*"
    r"|\[(?:\\.|[^\]\\\n])*\]|[A-Za-z_][\w-]*|[()|]"
)


def _check_lark(grammar: str, field: str, limits: StructuredOutputsConfig) -> None:
    """Rules counted; depth through rule references and parentheses; alternatives per rule (and per
    group), each regex literal's too."""
    starts = list(_DEFINITION.finditer(grammar))
    if len(starts) > limits.max_grammar_rules:
        raise GrammarLimitError(
            f"{field} defines {len(starts)} rules, more than the server's limit of "
            f"{limits.max_grammar_rules} (--max-grammar-rules)."
        )
    bodies: dict[str, str] = {}
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(grammar)
        bodies[match.group(1)] = bodies.get(match.group(1), "") + "\n|" + grammar[match.end() : end]

    def walk(name: str) -> tuple[int, list[tuple[int, str]]]:
        depth = deepest = 0
        counts = [0]
        refs: list[tuple[int, str]] = []
        for match in _LARK_TOKENS.finditer(bodies.get(name, "")):
            token = match.group()
            if token == "(":
                depth += 1
                deepest = max(deepest, depth)
                counts.append(1)
            elif token == ")" and len(counts) > 1:
                depth -= 1
                _check_alternatives(counts.pop(), field, limits)
            elif token == "|":
                counts[-1] += 1
            elif token.startswith("/"):
                _check_regex(token, field, limits)
            elif token in bodies and token != name:
                refs.append((depth + 1, token))
        _check_alternatives(max(counts), field, limits)
        _check_depth(deepest, field, limits)
        return deepest, refs

    first = "start" if "start" in bodies else next(iter(bodies), None)
    if first is not None:
        _check_depth(_longest_chain(first, walk), field, limits)
