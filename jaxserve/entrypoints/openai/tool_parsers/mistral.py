"""Mistral tool calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 and earlier
templates) or ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11+ templates); content before."""

from __future__ import annotations

import json

from jaxserve.entrypoints.openai.tool_parsers.base import FunctionCall, call_of, content_before

_START = "[TOOL_CALLS]"
_ARGS = "[ARGS]"


class MistralToolParser:
    name = "mistral"

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        at = text.find(_START)
        if at < 0:
            return text or None, []
        calls = self._calls(text[at:])
        if calls is None:
            return text or None, []
        return text[:at].strip() or None, calls

    def content_end(self, text: str) -> int:
        return content_before(text, _START)

    @staticmethod
    def _calls(text: str) -> list[FunctionCall] | None:
        parts = [p.strip() for p in text.split(_START) if p.strip()]
        calls: list[FunctionCall] = []
        for part in parts:
            if _ARGS in part:  # name[ARGS]{...}
                name, _, arguments = part.partition(_ARGS)
                call = call_of({"name": name.strip(), "arguments": arguments.strip()})
                if call is None:
                    return None
                calls.append(call)
                continue
            try:
                value = json.loads(part)
            except json.JSONDecodeError:
                return None
            for item in value if isinstance(value, list) else [value]:
                call = call_of(item)
                if call is None:
                    return None
                calls.append(call)
        return calls or None
