"""vLLM's `llama3_json` parser: Llama 3.1/3.2's JSON tool calls. An output that starts with
`<|python_tag|>` or `{` is all calls, JSON objects `{"name": ..., "arguments": {...}}` (or
`"parameters"`) separated by `;`; any other output is content."""

from __future__ import annotations

import re

from llmserve.entrypoints.openai.tool_parsers.call_scanner import CallScanner
from llmserve.entrypoints.openai.tool_parsers.tool_parser import Parsed, ToolParser, drafts_of

PYTHON_TAG = "<|python_tag|>"
_SEPARATOR = re.compile(r"\s*;")


class Llama3JsonToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._calls: bool | None = None  # None until the output's start tells
        self._scanners: list[CallScanner] = []

    def feed(self, delta: str) -> None:
        super().feed(delta)
        if self._calls is None:
            self._decide()
        while self._calls and self._scanners:
            last = self._scanners[-1]
            last.advance(self.text)
            separator = None if last.end is None else _SEPARATOR.match(self.text, last.end)
            if separator is None or last.error:
                return
            self._scanners.append(CallScanner(separator.end()))

    def _decide(self) -> None:
        stripped = self.text.lstrip()
        start = len(self.text) - len(stripped)
        if stripped.startswith(PYTHON_TAG):
            self._calls = True
            self._scanners.append(CallScanner(start + len(PYTHON_TAG)))
        elif stripped.startswith("{"):
            self._calls = True
            self._scanners.append(CallScanner(start))
        elif stripped and not PYTHON_TAG.startswith(stripped):
            self._calls = False

    def parse(self, final: bool) -> Parsed:
        if not self._calls:
            return Parsed(self.text if final or self._calls is False else "", [])
        scanners = self._scanners
        if final and not scanners[-1].started:  # a last ";" led to no call
            scanners = scanners[:-1]
        return drafts_of(scanners, self.text, ("arguments", "parameters"))
