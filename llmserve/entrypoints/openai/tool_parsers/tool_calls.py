"""A parser's calls as OpenAI sends them: whole in a response, as deltas in a stream."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from llmserve.entrypoints.openai.tool_parsers.tool_parser import ToolParser


def make_tool_call_id() -> str:
    """OpenAI's shape: `call_` and 24 characters."""
    return f"call_{uuid.uuid4().hex[:24]}"


def extract_tool_calls(
    parser: ToolParser, text: str, max_calls: int | None
) -> tuple[str | None, list[tuple[str, str]]]:
    """A finished output → (content, [(name, arguments)]). When a call is broken or unfinished (cut
    by max_tokens) the output is all content and there are no calls, as vLLM answers; with calls, an
    empty content is None, as OpenAI sends it."""
    parser.feed(text)
    parsed = parser.parse(final=True)
    kept = parsed.calls[:max_calls]  # cut first, as the stream does: what follows the kept calls is dropped
    broken_among_kept = parsed.broken and len(kept) == len(parsed.calls)
    if broken_among_kept or not all(c.complete and c.name is not None for c in kept):
        return text, []
    if not kept:
        return parsed.content, []
    return parsed.content or None, [(c.name, c.arguments) for c in kept if c.name is not None]


@dataclass
class ToolCallStream:
    """One sample's stream. Each call's first delta carries its index, id, type, name and the
    arguments so far (often ""); later deltas append to the arguments. A call is announced once its
    name is complete, and only after the calls before it, so indices arrive in order."""

    parser: ToolParser
    max_calls: int | None = None
    _content_sent: int = field(default=0, init=False)
    _arguments_sent: list[int] = field(default_factory=list, init=False)  # per call announced

    @property
    def called(self) -> bool:
        return bool(self._arguments_sent)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta for `text`, the output's next piece (`final` on the last): `content` and/or
        `tool_calls`, or nothing."""
        self.parser.feed(text)
        parsed = self.parser.parse(final)
        # a broken call before any call went out: the whole output was content after all
        content = self.parser.text if parsed.broken and not self.called else parsed.content
        out: dict[str, Any] = {}
        if len(content) > self._content_sent:
            out["content"] = content[self._content_sent :]
            self._content_sent = len(content)
        calls = [
            self._call_delta(i, c.name, c.arguments) for i, c in enumerate(parsed.calls[: self.max_calls])
        ]
        if any(calls):
            out["tool_calls"] = [c for c in calls if c]
        return out

    def _call_delta(self, index: int, name: str | None, arguments: str) -> dict[str, Any]:
        if index == len(self._arguments_sent) and name is not None:
            self._arguments_sent.append(len(arguments))
            return {
                "index": index,
                "id": make_tool_call_id(),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        if index < len(self._arguments_sent) and len(arguments) > self._arguments_sent[index]:
            sent, self._arguments_sent[index] = self._arguments_sent[index], len(arguments)
            return {"index": index, "function": {"arguments": arguments[sent:]}}
        return {}
