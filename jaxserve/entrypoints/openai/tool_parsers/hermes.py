"""Hermes / Qwen 2.5+ tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one block per call, content before the first block."""

from __future__ import annotations

import json
import re

from jaxserve.entrypoints.openai.tool_parsers.base import FunctionCall, call_of, content_before

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser:
    name = "hermes"
    start = "<tool_call>"

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        at = text.find(self.start)
        if at < 0:
            return text or None, []
        calls = []
        for body in _BLOCK.findall(text[at:]):
            try:
                call = call_of(json.loads(body.strip()))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text or None, []
            calls.append(call)
        return text[:at] or None, calls

    def content_end(self, text: str) -> int:
        return content_before(text, self.start)
