"""How a chat request uses its tools, decided (and refused with a 400) before the engine sees it.

As in vLLM: `tools` go to the chat template whatever `tool_choice` says; with tools, `tool_choice`
defaults to `auto`, which needs the server's `--enable-auto-tool-choice` and `--tool-call-parser`
(a 400 otherwise); `required` and a named function constrain the output to a schema built from the
tools (structured outputs), so they need no parser flag; `none` leaves the output all content.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from llmserve.entrypoints.openai.errors import OpenAIError
from llmserve.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from llmserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from llmserve.entrypoints.openai.tool_parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
    parameters_of,
    required_schema,
)
from llmserve.entrypoints.openai.tool_parsers.tool_parser import ToolParser

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True)
class ToolUse:
    """`tools` for the chat template; `parser` makes one `ToolParser` per sample (None: the output is
    all content); `schema` is the forced choices' structured output; `max_calls` is 1 when
    `parallel_tool_calls` is false. `calls_finish` is the finish reason of an output that made calls:
    `tool_calls`, but `stop` when `tool_choice` named the function, as OpenAI and vLLM answer."""

    tools: list[dict[str, Any]] | None = None
    parser: Callable[[], ToolParser] | None = None
    schema: dict[str, Any] | None = None
    max_calls: int | None = None
    calls_finish: str = "tool_calls"


def tool_use(request: ChatCompletionRequest, auto_parser: str | None) -> ToolUse:
    """`auto_parser`: the `--tool-call-parser` when `--enable-auto-tool-choice` is on, else None.
    Raises `OpenAIError` (400) naming `tool_choice` or `tools`."""
    tools = request.tools or []
    choice = request.tool_choice or ("auto" if tools else "none")
    if not tools:
        if choice in ("none", "auto") or choice == "required" and request.tools is not None:
            return ToolUse()  # nothing to call: vLLM turns `required` with `tools: []` into `none`
        if request.tools is None:
            raise OpenAIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    functions = [tool.function.model_dump(exclude_unset=True) for tool in tools]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise OpenAIError("tools must have distinct function names.", param="tools")
    use = ToolUse(
        tools=[tool.model_dump(exclude_unset=True) for tool in tools],
        max_calls=1 if request.parallel_tool_calls is False else None,
    )
    if choice == "none":
        return use
    if choice == "auto":
        if auto_parser is None:
            raise OpenAIError(AUTO_NEEDS_FLAGS, param="tool_choice")
        return replace(use, parser=TOOL_PARSERS[auto_parser])
    if choice == "required":
        try:
            schema = required_schema(functions, parallel=use.max_calls is None)
        except ValueError as e:
            raise OpenAIError(str(e), param="tools") from e
        return replace(use, parser=RequiredToolParser, schema=schema)
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    if name not in names:
        raise OpenAIError(
            f"The tool specified in `tool_choice` ({name!r}) does not match any of the specified `tools`.",
            param="tool_choice",
        )
    schema = parameters_of(functions[names.index(name)])
    return replace(use, parser=partial(NamedToolParser, name), schema=schema, calls_finish="stop")
