"""Tool-call parsers: the model's output text → OpenAI's `tool_calls`. `--tool-call-parser` picks one of
`TOOL_PARSERS` for `tool_choice: "auto"`; `required` and named choices use the parsers of `forced`."""

from __future__ import annotations

from llmserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from llmserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from llmserve.entrypoints.openai.tool_parsers.tool_parser import ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
