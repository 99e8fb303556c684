"""Llama 3.x JSON tool calls: the whole output is ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``."""

from __future__ import annotations

import json

from jaxserve.entrypoints.openai.tool_parsers.base import FunctionCall, call_of

_TAG = "<|python_tag|>"


class Llama3JsonToolParser:
    name = "llama3_json"

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        body = text.strip().removeprefix(_TAG).strip()
        if not body.startswith("{"):
            return text or None, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                value, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text or None, []
            call = call_of(value, "parameters")
            if call is None:
                return text or None, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or _TAG.startswith(stripped[: len(_TAG)]):
            return 0  # may still be a call: nothing is content for sure yet
        return len(text)
