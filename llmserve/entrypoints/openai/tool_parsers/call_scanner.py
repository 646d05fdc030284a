"""Reads one tool call's JSON object (`{"name": ..., "arguments": {...}}`) as the model writes it, a few
characters at a time: the top-level values once each is complete, and the raw text of the one still
being written. Raw text, not a re-serialization: what streams out is what the model wrote, so the
streamed argument pieces join into exactly the arguments a non-streamed response carries."""

from __future__ import annotations

import json


class CallScanner:
    """Scans `text[start:]` (whitespace, then one JSON object) incrementally: each `advance(text)` reads
    what was appended since the last. Values of the object's keys are kept as spans of `text`, checked
    only for their nesting (a value is parsed by whoever reads it). `end` is set (the index after the
    closing brace) once the object is complete; `error` once the text cannot be a JSON object."""

    def __init__(self, start: int) -> None:
        self.start = start  # where the object may begin in the text
        self.values: dict[str, tuple[int, int]] = {}  # key → span of its raw value, once complete
        self.open_value: tuple[str, int] | None = None  # the key whose value is being read, its start
        self.end: int | None = None
        self.error = False
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "key"  # at depth 1: "key", "colon", "value" or "comma"
        self._key = ""
        self._token: int | None = None  # start of the key or value being read at depth 1
        self._scalar = False  # that token is a bare number, true, false or null

    def advance(self, text: str) -> None:
        i = self._pos
        while i < len(text) and self.end is None and not self.error:
            self._read(text, i)
            i += 1
        self._pos = i

    def _read(self, text: str, i: int) -> None:
        c = text[i]
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 1:
                    self._close(text, i + 1)
            return
        if self._depth == 0:
            if c == "{":
                self._depth = 1
            elif not c.isspace():
                self.error = True
            return
        if self._scalar and (c in ",}]" or c.isspace()):
            self._close(text, i)
        if self._depth > 1:
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._close(text, i + 1)
            return
        self._read_top(c, i)

    def _read_top(self, c: str, i: int) -> None:
        """One character between the object's own braces, outside any string or nested value."""
        opens = c == '"' or (self._expect == "value" and not c.isspace() and c not in ",:}]")
        if opens and self._expect in ("key", "value") and self._token is None:
            self._token = i
            self._in_string = c == '"'
            self._depth += c in "{["
            self._scalar = c not in '"{['
            if self._expect == "value":
                self.open_value = (self._key, i)
            if self._expect == "key" and c != '"':
                self.error = True
        elif c == ":" and self._expect == "colon":
            self._expect = "value"
        elif c == "," and self._expect == "comma":
            self._expect = "key"
        elif c == "}" and self._expect in ("key", "comma"):
            self._depth, self.end = 0, i + 1
        elif not c.isspace() and self._token is None:
            self.error = True

    def _close(self, text: str, end: int) -> None:
        start, self._token, self._scalar = self._token, None, False
        if start is None:
            return
        if self._expect == "key":
            try:
                self._key, self._expect = json.loads(text[start:end]), "colon"
            except ValueError:  # a bad escape
                self.error = True
        else:
            self.values[self._key] = (start, end)
            self.open_value, self._expect = None, "comma"

    @property
    def started(self) -> bool:
        """Past the object's opening brace (before it, the text read is whitespace)."""
        return self._depth > 0 or self.end is not None

    def raw(self, text: str, key: str) -> str | None:
        """The value of `key` as written so far (trailing whitespace dropped), complete or not; None
        before it starts."""
        if key in self.values:
            start, end = self.values[key]
            return text[start:end]
        if self.open_value is not None and self.open_value[0] == key:
            return text[self.open_value[1] : self._pos].rstrip()
        return None

    def string(self, text: str, key: str) -> str | None:
        """The value of `key` once complete, when it is a JSON string."""
        if key not in self.values:
            return None
        start, end = self.values[key]
        try:
            value = json.loads(text[start:end])
        except ValueError:
            return None
        return value if isinstance(value, str) else None
