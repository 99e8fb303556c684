"""What a tool-call parser is: it reads the tool calls a model wrote in its chat format out of
the generated text (tool_choice "auto"), and says how much of a text being streamed is plain
content for sure (the rest may be the start of a call)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class FunctionCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolParser(Protocol):
    name: str

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """(the content outside the calls, None when empty; the calls). Text whose calls do not
        parse is content, calls none (as vLLM's parsers do)."""
        ...

    def content_end(self, text: str) -> int:
        """How many leading characters of ``text`` (an unfinished output) are content whatever
        comes next: a stream may send them before the output ends."""
        ...


def call_of(value: Any, arguments_key: str = "arguments") -> FunctionCall | None:
    """A FunctionCall from {"name": str, <arguments_key>: object or JSON text}, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            return None
        return FunctionCall(value["name"], arguments)
    return FunctionCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def content_before(text: str, marker: str) -> int:
    """The end of the content before ``marker`` in ``text``: where the marker starts, or, when
    it does not occur, where a suffix that could begin it starts (len(text) if none)."""
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)
