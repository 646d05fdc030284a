"""vLLM's `hermes` parser: Hermes 2 Pro's format, which the chat templates of Qwen2.5 and Qwen3 ask
for. Each call is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
`</tool_call>`; the text before the first call is the content, anything after the last is dropped."""

from __future__ import annotations

from dataclasses import replace

from llmserve.entrypoints.openai.tool_parsers.call_scanner import CallScanner
from llmserve.entrypoints.openai.tool_parsers.tool_parser import Parsed, ToolParser, drafts_of, held_back

START = "<tool_call>"


class HermesToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._scanners: list[CallScanner] = []

    def feed(self, delta: str) -> None:
        super().feed(delta)
        while True:
            last = self._scanners[-1] if self._scanners else None
            if last is not None:
                last.advance(self.text)
                if last.end is None or last.error:
                    return
            begin = self.text.find(START, 0 if last is None or last.end is None else last.end)
            if begin < 0:
                return
            self._scanners.append(CallScanner(begin + len(START)))

    def parse(self, final: bool) -> Parsed:
        if not self._scanners:
            return Parsed(self.text if final else held_back(self.text, START), [])
        content = self.text[: self.text.find(START)]
        scanners = self._scanners
        if final and len(scanners) > 1 and not self.text[scanners[-1].start :].strip():
            scanners = scanners[:-1]  # a last `<tool_call>` with nothing after it: no call begun
        return replace(drafts_of(scanners, self.text, ("arguments",)), content=content)
