"""Tool calls in chat answers: the message of a finished answer, and the deltas of a streamed
one, for a request's ToolChoice (protocol/tools.py) and the server's tool-call parser.

A forced call ("required", a named function) was generated as JSON under the grammar: a named
function's arguments stream as they come, "required"'s array is read when the answer ends. An
"auto" answer streams its content until the parser sees what may begin a call, and its calls
when it ends. Text that does not parse as calls (an answer cut by max_tokens) is content.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from jaxserve.entrypoints.openai.protocol.tools import ToolChoice
from jaxserve.entrypoints.openai.tool_parsers import FunctionCall, ToolParser
from jaxserve.entrypoints.openai.tool_parsers.base import call_of


def calls_in(
    choice: ToolChoice | None, parser: ToolParser | None, text: str
) -> tuple[str | None, list[FunctionCall]]:
    """(content, calls) of a finished answer."""
    if choice is None or choice.mode == "none":
        return text, []
    if choice.mode == "named":
        return None, [FunctionCall(choice.named, text)]
    if choice.mode == "required":
        calls = _required_calls(text)
        return (None, calls) if calls else (text, [])
    content, calls = parser.extract(text)
    # parallel_tool_calls=false: one call an answer; a model that wrote more gets the first.
    return content, calls if choice.parallel else calls[:1]


def _required_calls(text: str) -> list[FunctionCall]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    calls = [call_of(item, "parameters") for item in items] if isinstance(items, list) else []
    return calls if calls and all(calls) else []


def tool_call_body(call: FunctionCall, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
    body["function"] = {"name": call.name, "arguments": call.arguments}
    return body if index is None else {"index": index, **body}


def finish_reason_of(choice: ToolChoice | None, has_calls: bool, reason: str | None) -> Any:
    """OpenAI's: "tool_calls" when the model chose to call ("auto", "required"); a forced
    named function ends with "stop"."""
    if has_calls and reason == "stop" and choice is not None and choice.mode != "named":
        return "tool_calls"
    return reason


def chat_message(
    choice: ToolChoice | None, parser: ToolParser | None, text: str, reason: str | None
) -> tuple[dict[str, Any], Any]:
    """(the assistant message of a finished answer, its finish_reason)."""
    content, calls = calls_in(choice, parser, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [tool_call_body(c) for c in calls]
    return message, finish_reason_of(choice, bool(calls), reason)


class ToolCallStream:
    """The deltas of one streamed answer (one per choice index)."""

    def __init__(self, choice: ToolChoice | None, parser: ToolParser | None) -> None:
        self.choice = choice
        self.parser = parser
        self.mode = "none" if choice is None else choice.mode
        self.text = ""
        self._num_sent = 0  # characters of text sent as content
        self._call_id: str | None = None
        self.has_calls = False

    def deltas(self, new_text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas to send for ``new_text`` (``finished``: the answer ended with it)."""
        self.text += new_text
        if self.mode == "none":
            return [{"content": new_text}] if new_text else []
        if self.mode == "named":
            return self._named(new_text)
        out = []
        if self.mode == "auto" and not finished:
            end = self.parser.content_end(self.text)
            if end > self._num_sent:
                out.append({"content": self.text[self._num_sent : end]})
                self._num_sent = end
        if finished:
            out += self._final()
        return out

    def finish_reason(self, reason: str | None) -> Any:
        return finish_reason_of(self.choice, self.has_calls, reason)

    def _named(self, new_text: str) -> list[dict[str, Any]]:
        self.has_calls = True
        if self._call_id is None:
            call = tool_call_body(FunctionCall(self.choice.named, new_text), index=0)
            self._call_id = call["id"]
            return [{"tool_calls": [call]}]
        if not new_text:
            return []
        return [{"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]}]

    def _final(self) -> list[dict[str, Any]]:
        content, calls = calls_in(self.choice, self.parser, self.text)
        if not calls:
            rest = self.text[self._num_sent :]
            return [{"content": rest}] if rest else []
        self.has_calls = True
        out = []
        unsent = (content or "")[self._num_sent :]
        if unsent:
            out.append({"content": unsent})
        out += [{"tool_calls": [tool_call_body(c, index=i)]} for i, c in enumerate(calls)]
        return out
