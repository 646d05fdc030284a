"""`tool_choice: "required"` and a named function: the output is constrained (structured outputs) to a
schema built from the tools, as vLLM builds it, so it always parses into calls.

- a named function: the output is that function's arguments, one JSON object of its `parameters`;
- `required`: the output is a JSON array of `{"name": ..., "parameters": {...}}`, one or more calls
  (exactly one when `parallel_tool_calls` is false).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from llmserve.entrypoints.openai.tool_parsers.call_scanner import CallScanner
from llmserve.entrypoints.openai.tool_parsers.tool_parser import (
    CallDraft,
    Parsed,
    ToolParser,
    drafts_of,
    is_json,
)

# A function without `parameters` takes none (OpenAI's rule).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_NEXT_CALL = re.compile(r"\s*,")


def parameters_of(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or NO_PARAMETERS


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for `required`: an array of calls, each one of the functions. The parameters'
    `$defs` move to the root, where their `#/$defs/...` references point; two functions defining one
    name differently raise `ValueError`."""
    defs: dict[str, Any] = {}
    choices = []
    for function in functions:
        parameters = copy.deepcopy(parameters_of(function))
        own = parameters.pop("$defs", {})
        if not isinstance(own, dict):
            raise ValueError(f"The $defs of function {function['name']!r} must be an object.")
        for name, definition in own.items():
            if defs.setdefault(name, definition) != definition:
                raise ValueError(f"tools define $defs/{name} twice, differently: one definition is needed.")
        choices.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,  # the call ends after its parameters
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class NamedToolParser(ToolParser):
    """The output is the named function's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def parse(self, final: bool) -> Parsed:
        arguments = self.text.strip()
        if final and not is_json(arguments):
            return Parsed("", [], broken=True)
        return Parsed("", [CallDraft(self.name, arguments, final)])


class RequiredToolParser(ToolParser):
    """The output is a JSON array of calls."""

    def __init__(self) -> None:
        super().__init__()
        self._scanners: list[CallScanner] = []

    def feed(self, delta: str) -> None:
        super().feed(delta)
        if not self._scanners:
            opening = self.text.find("[")
            if opening < 0:
                return
            self._scanners.append(CallScanner(opening + 1))
        while True:
            last = self._scanners[-1]
            last.advance(self.text)
            comma = None if last.end is None else _NEXT_CALL.match(self.text, last.end)
            if comma is None or last.error:
                return
            self._scanners.append(CallScanner(comma.end()))

    def parse(self, final: bool) -> Parsed:
        return drafts_of(self._scanners, self.text, ("parameters",))
