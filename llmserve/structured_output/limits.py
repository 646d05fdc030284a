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

from llguidance.gbnf_to_lark import any_to_lark

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
            _check_depth(_json_text_depth(schema)[0], field, limits)
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
        _check_lark(params.grammar, field, limits)
    if params.whitespace_pattern is not None:
        where = "structured_outputs.whitespace_pattern"
        _check_bytes(len(params.whitespace_pattern.encode("utf-8", "surrogatepass")), where, limits)
        _check_regex(params.whitespace_pattern, where, limits)


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

# Strings, then brackets. Every construct matches through the end of the text when it is left open
# (possessive, no backtracking), so a scan is linear on any input.
_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*+"?|[\[\]{}]', re.DOTALL)


def _json_text_depth(text: str, start: int = 0) -> tuple[int, int]:
    """(how deeply the JSON value at `start` of `text` nests, where it ends), without parsing it (the
    parser recurses per level)."""
    depth = deepest = 0
    for match in _BRACKETS.finditer(text, start):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
            if depth == 0:
                return deepest, match.end()
    return deepest, len(text)


# Keywords whose value is a list of alternative subschemas, or of allowed values.
_ALTERNATIVE_KEYS = ("anyOf", "oneOf", "allOf", "enum", "prefixItems")


def _check_schema(schema: Any, field: str, limits: StructuredOutputsConfig) -> None:
    """Depth counts each object and array of the schema, and goes on through each `$ref` into its target
    (a `$ref` chain nests as deep as the schemas it links), as a compiler expanding the schema would; a
    `$ref` back into its own chain is recursion, which the grammar keeps as a rule. Each node a `$ref`
    reaches is walked once, however many `$ref`s reach it."""
    nodes: dict[int, Any] = {id(schema): schema}
    targets: dict[str, int] = {}

    def target(ref: str) -> int:
        if ref not in targets:
            if not ref.startswith("#") or ref[1:2] not in ("", "/"):
                raise GrammarLimitError(
                    f"{field} has a $ref to {ref[:100]!r}: only references within the schema, as JSON "
                    "pointers (#/...), are accepted."
                )
            node = _resolve(schema, ref[1:])
            nodes[id(node)] = node
            targets[ref] = id(node)
        return targets[ref]

    def walk(key: int) -> tuple[int, list[tuple[int, int]]]:
        deepest, refs = 0, []
        stack: list[tuple[Any, int]] = [(nodes[key], 1)]
        while stack:
            node, depth = stack.pop()
            if isinstance(node, dict):
                deepest = max(deepest, depth)
                _check_depth(deepest, field, limits)
                ref = node.get("$ref")
                if isinstance(ref, str):
                    refs.append((depth, target(ref)))
                for name in _ALTERNATIVE_KEYS:
                    if isinstance(node.get(name), list):
                        _check_alternatives(len(node[name]), field, limits)
                stack.extend((child, depth + 1) for child in node.values())
            elif isinstance(node, list):
                deepest = max(deepest, depth)
                _check_depth(deepest, field, limits)
                stack.extend((child, depth + 1) for child in node)
        return deepest, refs

    _check_chains([id(schema)], walk, field, limits)


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


def _check_chains(
    starts: Iterable[Hashable],
    walk: Callable[[Any], tuple[int, Iterable[tuple[int, Any]]]],
    field: str,
    limits: StructuredOutputsConfig,
) -> None:
    """Refuses, as soon as one is found, a chain of references from any of `starts` that nests deeper
    than the limit: `walk(unit)` gives the unit's own depth and its references as (depth at the
    reference, unit referred to). Each unit is walked once (a DAG of references costs its size, not its
    number of paths); a reference back into the current chain adds nothing. Iterative: chains of any
    length."""
    done: dict[Any, int] = {}  # unit → the deepest nesting below it, itself included
    for start in starts:
        if start in done:
            continue
        own, refs = walk(start)
        # [unit, depth at which it starts, the deepest below it so far, references still to follow]
        stack: list[list[Any]] = [[start, 0, own, list(refs)]]
        on_chain = {start}
        while stack:
            frame = stack[-1]
            unit, base, deepest, pending = frame
            if not pending:
                stack.pop()
                on_chain.discard(unit)
                done[unit] = deepest
                continue
            depth, ref = pending.pop()
            if ref in done:
                frame[2] = max(deepest, depth + done[ref])
                _check_depth(base + frame[2], field, limits)
            elif ref not in on_chain:
                ref_own, ref_refs = walk(ref)
                _check_depth(base + depth + ref_own, field, limits)
                pending.append((depth, ref))  # taken again once `ref` is done
                on_chain.add(ref)
                stack.append([ref, base + depth, ref_own, list(ref_refs)])


# --- regular expressions and Lark / GBNF grammars ----------------------------------------------------

_REGEX_TOKENS = re.compile(r"\\.|\[(?:\\.|[^\]\\])*+\]?|[()|]", re.DOTALL)


class _Groups:
    """Parenthesised groups as their tokens go by: how deep they nest, and the most alternatives (`|`)
    of one group or of the whole."""

    def __init__(self) -> None:
        self.depth = self.deepest = 0
        self.counts = [1]  # alternatives of each open group, the whole first
        self.widest = 1

    def take(self, token: str) -> bool:
        """False for a token that is not `(`, `)` or `|`."""
        if token == "(":
            self.depth += 1
            self.deepest = max(self.deepest, self.depth)
            self.counts.append(1)
        elif token == ")":
            if len(self.counts) > 1:
                self.depth -= 1
                self.widest = max(self.widest, self.counts.pop())
        elif token == "|":
            self.counts[-1] += 1
        else:
            return False
        return True

    @property
    def alternatives(self) -> int:
        return max(self.widest, *self.counts)


def _check_regex(regex: str, field: str, limits: StructuredOutputsConfig) -> None:
    groups = _Groups()
    for match in _REGEX_TOKENS.finditer(regex):
        groups.take(match.group())
    _check_depth(groups.deepest, field, limits)
    _check_alternatives(groups.alternatives, field, limits)


# A definition starts a line: `name:`, `?name:`, `!name:`, `name.2:`, `NAME:`; GBNF's `name ::=`.
_DEFINITION = re.compile(r"^[ \t]*[?!]?([A-Za-z_][\w-]*)(?:\.-?\d+)?[ \t]*:(?!:)", re.MULTILINE)
_GBNF_DEFINITION = re.compile(r"^[ \t]*[A-Za-z_][\w-]*[ \t]*::=", re.MULTILINE)
_LARK_TOKENS = re.compile(
    r"//[^\n]*|\"(?:[^\"\\\n]|\\.)*+\"?i?|'(?:[^'\\\n]|\\.)*+'?|/(?:[^/\\\n]|\\.)++/?[imslux]*"
    r"|\[(?:\\.|[^\]\\\n])*+\]?|%json\b|[A-Za-z_][\w-]*|[()|]"
)


def _check_lark(grammar: str, field: str, limits: StructuredOutputsConfig) -> None:
    """Rules counted; depth through rule references, parentheses and the schemas of `%json`;
    alternatives per rule and per group, each regex literal's too. Every rule is walked, reachable or
    not. GBNF is checked as llguidance's Lark conversion of it, once its rules are counted (the
    conversion takes time quadratic in them)."""
    _check_rules(len(_GBNF_DEFINITION.findall(grammar)), field, limits)
    try:
        grammar = any_to_lark(grammar)
    except Exception:  # noqa: BLE001 (neither Lark nor GBNF: `to_grammar` refuses it)
        return
    starts = list(_DEFINITION.finditer(grammar))
    _check_rules(len(starts), field, limits)
    bodies: dict[str, list[tuple[int, int]]] = {}
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(grammar)
        bodies.setdefault(match.group(1), []).append((match.end(), end))

    def walk(name: str) -> tuple[int, list[tuple[int, str]]]:
        deepest, refs = 0, []
        for begin, end in bodies[name]:
            groups, skip_to = _Groups(), begin
            for match in _LARK_TOKENS.finditer(grammar, begin, end):
                token = match.group()
                if match.start() < skip_to or groups.take(token):
                    continue
                if token == "%json":
                    skip_to = _check_inline_schema(grammar, match.end(), field, limits)
                elif token.startswith("/"):
                    _check_regex(token, field, limits)
                elif token in bodies and token != name:
                    refs.append((groups.depth + 1, token))
            _check_alternatives(groups.alternatives, field, limits)
            deepest = max(deepest, groups.deepest)
        _check_depth(deepest, field, limits)
        return deepest, refs

    _check_chains(bodies, walk, field, limits)


def _check_rules(count: int, field: str, limits: StructuredOutputsConfig) -> None:
    if count > limits.max_grammar_rules:
        raise GrammarLimitError(
            f"{field} defines {count} rules, more than the server's limit of {limits.max_grammar_rules} "
            "(--max-grammar-rules)."
        )


def _check_inline_schema(grammar: str, start: int, field: str, limits: StructuredOutputsConfig) -> int:
    """The JSON schema of a `%json { ... }` at `start`, checked as a `json` field is; where it ends."""
    depth, end = _json_text_depth(grammar, start)
    _check_depth(depth, field, limits)
    try:
        schema = json.loads(grammar[start:end])
    except ValueError:
        return end  # not JSON: llguidance says so
    _check_schema(schema, field, limits)
    return end
