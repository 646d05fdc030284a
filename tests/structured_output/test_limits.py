"""`check_limits`: hostile schemas and grammars are refused by name, in Python, before llguidance's
recursive validation sees them (which overflowed the stack and killed the server at a `$ref` chain of
about 1,000, a Lark rule chain of about 3,000); ordinary ones pass."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest

from llmserve.config import StructuredOutputsConfig
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured_output.limits import GrammarLimitError, check_limits

LIMITS = StructuredOutputsConfig()


def ref_chain(n: int) -> dict[str, Any]:
    """{"$ref": d0}, d_i an object whose one property is d_{i+1}, d_n a string."""
    defs: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: r{i + 1} "a"' for i in range(n)) + f'\nr{n}: "b"'


def nested_schema_text(n: int) -> str:
    return '{"type": "object", "properties": {"a": ' * n + '{"type": "string"}' + "}}" * n


def refused(params: StructuredOutputsParams, limits: StructuredOutputsConfig = LIMITS) -> str:
    with pytest.raises(GrammarLimitError) as e:
        check_limits(params, limits)
    assert f"structured_outputs.{params.kind}" in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("n", [1_000, 10_000])
def test_a_ref_chain_is_refused_by_depth(n: int) -> None:
    assert "--max-grammar-depth" in refused(StructuredOutputsParams(json=ref_chain(n)))


def test_a_ref_chain_as_text_is_refused_by_depth() -> None:
    assert "--max-grammar-depth" in refused(StructuredOutputsParams(json=json.dumps(ref_chain(1_000))))


def test_a_deeply_nested_schema_text_is_refused_before_it_is_parsed() -> None:
    """json.loads recurses per level: 2,000 levels raised RecursionError, a 500."""
    assert "--max-grammar-depth" in refused(StructuredOutputsParams(json=nested_schema_text(2_000)))


def test_ordinary_and_recursive_schemas_pass() -> None:
    check_limits(StructuredOutputsParams(json=ref_chain(20)), LIMITS)
    check_limits(StructuredOutputsParams(json=nested_schema_text(20)), LIMITS)
    tree = {
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#"}},
                },
            }
        },
    }
    check_limits(StructuredOutputsParams(json=tree), LIMITS)
    check_limits(StructuredOutputsParams(json_object=True), LIMITS)


def test_a_dag_of_refs_is_walked_once_per_definition() -> None:
    """Each definition refers to the next twice: 2**60 paths, 60 definitions; depth 4 each."""
    defs: dict[str, Any] = {
        f"d{i}": {
            "type": "object",
            "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}, "b": {"$ref": f"#/$defs/d{i + 1}"}},
        }
        for i in range(60)
    }
    defs["d60"] = {"type": "string"}
    schema = {"$ref": "#/$defs/d0", "$defs": defs}
    check_limits(StructuredOutputsParams(json=schema), StructuredOutputsConfig(max_grammar_depth=1_000))
    refused(StructuredOutputsParams(json=schema), StructuredOutputsConfig(max_grammar_depth=100))


@pytest.mark.parametrize("n", [3_000, 30_000])
def test_a_lark_rule_chain_is_refused(n: int) -> None:
    assert "--max-grammar-rules" in refused(StructuredOutputsParams(grammar=lark_chain(n)))


def test_a_lark_rule_chain_within_the_rule_count_is_refused_by_depth() -> None:
    assert "--max-grammar-depth" in refused(StructuredOutputsParams(grammar=lark_chain(500)))
    check_limits(StructuredOutputsParams(grammar=lark_chain(50)), LIMITS)


def test_gbnf_and_parentheses_count_too() -> None:
    gbnf = "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} "a"' for i in range(300)) + '\nr300 ::= "b"'
    assert "--max-grammar-depth" in refused(StructuredOutputsParams(grammar=gbnf))
    parens = "start: " + "(" * 200 + '"a"' + ")" * 200
    assert "--max-grammar-depth" in refused(StructuredOutputsParams(grammar=parens))
    check_limits(StructuredOutputsParams(grammar='start: ("a" | "b" "c")+ /[0-9]+/ // a comment ((('), LIMITS)


def test_wide_alternations_are_refused() -> None:
    options = [f"option{i}" for i in range(20_000)]
    assert "--max-grammar-alternatives" in refused(StructuredOutputsParams(regex="|".join(options)))
    assert "--max-grammar-alternatives" in refused(
        StructuredOutputsParams(choice=[f"c{i}" for i in range(100_000)])
    )
    enum = {"enum": options}
    assert "--max-grammar-alternatives" in refused(StructuredOutputsParams(json=enum))
    lark = "start: " + " | ".join(json.dumps(o) for o in options)
    assert "--max-grammar-alternatives" in refused(StructuredOutputsParams(grammar=lark))
    check_limits(StructuredOutputsParams(regex="|".join(options[:100])), LIMITS)
    check_limits(
        StructuredOutputsParams(regex=r"[|]+\|"), StructuredOutputsConfig(max_grammar_alternatives=1)
    )


def test_deep_regex_groups_and_whitespace_patterns_are_refused() -> None:
    assert "--max-grammar-depth" in refused(StructuredOutputsParams(regex="(" * 500 + "a" + ")" * 500))
    deep = StructuredOutputsParams(json_object=True, whitespace_pattern="(" * 500 + " " + ")" * 500)
    with pytest.raises(GrammarLimitError, match="structured_outputs.whitespace_pattern"):
        check_limits(deep, LIMITS)


def test_size_is_refused_past_the_byte_limit() -> None:
    small = StructuredOutputsConfig(max_grammar_bytes=1_000)
    assert "--max-grammar-bytes" in refused(StructuredOutputsParams(regex="a" * 1_001), small)
    assert "--max-grammar-bytes" in refused(StructuredOutputsParams(grammar="start: " + '"a"' * 400), small)
    check_limits(StructuredOutputsParams(regex="a" * 1_000), small)


def test_the_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_grammar_depth"):
        StructuredOutputsConfig(max_grammar_depth=0)
    with pytest.raises(ValueError, match="grammar_timeout"):
        StructuredOutputsConfig(grammar_timeout=0)


def test_a_schema_object_is_measured_as_its_json() -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(100)}}
    assert "--max-grammar-bytes" in refused(
        StructuredOutputsParams(json=schema), StructuredOutputsConfig(max_grammar_bytes=1_000)
    )


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(regex="[" * (1 << 20)),
        StructuredOutputsParams(json='["' + '"\\' * (1 << 18)),
        StructuredOutputsParams(grammar='start: "a"\n' + '"\\' * (1 << 18)),
        StructuredOutputsParams(grammar='start: "a"\n' + "[" * ((1 << 20) - 16)),
        StructuredOutputsParams(grammar="start: /" + "a" * ((1 << 20) - 16)),
    ],
)
def test_unclosed_strings_and_classes_are_scanned_once(params: StructuredOutputsParams) -> None:
    """A string, class or regex left open matched to the end of the text from every position where it
    might start: 40 KB took 46 s. Each construct now consumes the rest at once; quadratic here would
    take hours."""
    with contextlib.suppress(GrammarLimitError):
        check_limits(params, LIMITS)


def test_every_rule_is_counted_and_walked() -> None:
    """`!name:` rules (kept in the tree), rules no other reaches, and GBNF whose `root` is not first."""
    bang = "start: r0\n" + "".join(f"!r{i}: r{i + 1}\n" for i in range(3_000)) + '!r3000: "b"'
    assert "--max-grammar-rules" in refused(StructuredOutputsParams(grammar=bang))
    unreachable = 'start: "a"\n' + "\n".join(f'r{i}: r{i + 1} "a"' for i in range(500)) + '\nr500: "b"'
    assert "--max-grammar-depth" in refused(StructuredOutputsParams(grammar=unreachable))
    gbnf = (
        'a ::= "x"\nroot ::= r0\n'
        + "\n".join(f'r{i} ::= r{i + 1} "a"' for i in range(300))
        + '\nr300 ::= "b"'
    )
    assert "--max-grammar-depth" in refused(StructuredOutputsParams(grammar=gbnf))
    many = "root ::= r0\n" + "\n".join(f'r{i} ::= "a"' for i in range(3_000))
    assert "--max-grammar-rules" in refused(StructuredOutputsParams(grammar=many))


def test_a_schema_inside_a_grammar_is_checked_as_a_schema() -> None:
    inline = "start: %json " + json.dumps(ref_chain(1_000))
    assert "--max-grammar-depth" in refused(StructuredOutputsParams(grammar=inline))
    check_limits(StructuredOutputsParams(grammar='start: "x" %json {"type": "integer"}'), LIMITS)


def test_only_json_pointer_refs_are_followed_the_rest_refused() -> None:
    """A `$ref` through `$id` or an anchor is resolved by llguidance, not by this walk: refused."""
    by_id = {"$id": "urn:a", "$ref": "urn:a#/$defs/d0", "$defs": {"d0": {"type": "string"}}}
    assert "only references within the schema" in refused(StructuredOutputsParams(json=by_id))
    anchor = {"type": "object", "properties": {"a": {"$ref": "#x"}}}
    assert "only references within the schema" in refused(StructuredOutputsParams(json=anchor))


def test_many_refs_to_one_node_walk_it_once() -> None:
    """800 spellings of one pointer (leading zeros) into a 200-item list: walked per node, not per
    spelling (it took 9 s)."""
    schema = {
        "type": "object",
        "$defs": {
            "l": [{"type": "object", "properties": {f"q{j}": {"type": "string"} for j in range(20)}}] * 200
        },
        "properties": {f"p{i}": {"$ref": "#/$defs/l/" + "0" * (i + 1)} for i in range(800)},
    }
    check_limits(StructuredOutputsParams(json=schema), StructuredOutputsConfig(max_grammar_bytes=1 << 22))
