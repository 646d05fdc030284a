"""The contract of a tool-call parser: one sample's output text, as it grows, split into content and
the tool calls begun so far. Parsers differ in where calls sit in the text; each call is one JSON
object read by a `CallScanner`."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from llmserve.entrypoints.openai.tool_parsers.call_scanner import CallScanner


@dataclass(frozen=True)
class CallDraft:
    """One tool call as far as the model has written it. `name` is None until complete; `arguments`
    is the raw JSON text so far, which only grows (`"{}"` for a finished call that gave none)."""

    name: str | None
    arguments: str
    complete: bool


@dataclass(frozen=True)
class Parsed:
    """The output so far. `content` only grows from one parse to the next. `broken`: a call's text is
    not a valid call (not JSON, no name, arguments that do not parse); `calls` stop before it."""

    content: str
    calls: list[CallDraft]
    broken: bool = False


class ToolParser(ABC):
    """Reads one sample's output as it grows; one instance per sample, since it keeps its place."""

    def __init__(self) -> None:
        self.text = ""

    def feed(self, delta: str) -> None:
        """Appends the output's next piece; parsers that keep scanners advance them here."""
        self.text += delta

    @abstractmethod
    def parse(self, final: bool) -> Parsed:
        """The content and calls so far. Unless `final`, text that may yet turn out to open a call is
        held back from the content."""


def drafts_of(scanners: Sequence[CallScanner], text: str, argument_keys: Sequence[str]) -> Parsed:
    """The calls `scanners` have read, each an object with a `name` and its arguments under the first
    of `argument_keys` present; `content` is left empty for the caller to fill."""
    calls: list[CallDraft] = []
    for scanner in scanners:
        name = scanner.string(text, "name")
        arguments = next((a for k in argument_keys if (a := scanner.raw(text, k)) is not None), "")
        complete = scanner.end is not None
        if complete and not arguments:
            arguments = "{}"
        if scanner.error or complete and (name is None or not is_json(arguments)):
            return Parsed("", calls, broken=True)
        calls.append(CallDraft(name, arguments, complete))
    return Parsed("", calls)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def held_back(text: str, marker: str) -> str:
    """`text` without its longest ending that could be the start of `marker`: the rest of the marker
    may be on its way."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text
