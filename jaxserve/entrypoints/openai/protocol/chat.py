"""POST /v1/chat/completions: the request model, its checks and the conversation it holds."""

from __future__ import annotations

import json
from typing import Any

from jaxserve.entrypoints.openai.protocol.errors import OpenAIError, short_repr
from jaxserve.entrypoints.openai.protocol.fields import (
    REFUSED_COMMON,
    SamplingRequest,
    StrictBody,
    parse_request,
)


class ChatMessage(StrictBody):
    role: str
    content: Any = None  # str or a list of text parts: chat_messages checks it
    name: str | None = None
    tool_call_id: str | None = None
    # What an assistant message of OpenAI's SDK carries, accepted when empty (chat_messages).
    tool_calls: Any = None
    function_call: Any = None
    refusal: Any = None


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # null: what the context leaves
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template: str | None = None  # vLLM's: a jinja2 template instead of the model's
    add_generation_prompt: bool = True
    # Tool calling (tools.py checks them).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


_REFUSED_CHAT = {
    **REFUSED_COMMON,
    "functions": ([], "the deprecated function calling: use tools"),
    "function_call": ("none", "the deprecated function calling: use tool_choice"),
}


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """A /v1/chat/completions body -> ChatCompletionRequest.

    Raises:
        OpenAIError (400): as parse_completion_request; max_tokens and max_completion_tokens
            both given and different; top_logprobs without logprobs=true.
    """
    request = parse_request(ChatCompletionRequest, body, _REFUSED_CHAT)
    assert isinstance(request, ChatCompletionRequest)
    a, b = request.max_tokens, request.max_completion_tokens
    if a is not None and b is not None and a != b:
        raise OpenAIError(
            f"max_tokens ({a}) and max_completion_tokens ({b}) differ; give one of them "
            "(max_tokens is the deprecated name of max_completion_tokens)",
            param="max_completion_tokens",
        )
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIError(
            f"top_logprobs={request.top_logprobs} needs logprobs=true", param="top_logprobs"
        )
    return request


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it: role, content (text parts joined with a
    newline, as vLLM does), name and tool_call_id when given, an assistant's tool_calls (their
    arguments as objects, as Hugging Face templates read them).

    Raises:
        OpenAIError (400): content that is not text, malformed tool calls, a function_call.
    """
    messages = []
    for i, message in enumerate(request.messages):
        for name in ("function_call", "refusal"):
            if getattr(message, name) not in (None, []):
                raise OpenAIError(
                    f"messages[{i}].{name} is not supported (function_call is deprecated: use "
                    "tool_calls)",
                    param=f"messages[{i}].{name}",
                )
        calls = _tool_calls(i, message.tool_calls)
        content = "" if message.content is None and calls else message.content
        out: dict[str, Any] = {"role": message.role, "content": _message_text(i, content)}
        if calls:
            out["tool_calls"] = calls
        if message.name is not None:
            out["name"] = message.name
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        messages.append(out)
    return messages


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    if calls in (None, []):
        return []
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise OpenAIError(f"{where} must be a list, got {short_repr(calls)}", param=where)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise OpenAIError(
                f'{where}[{j}] must be {{"id", "type": "function", "function": {{"name", '
                f'"arguments"}}}}, got {short_repr(call)}',
                param=f"{where}[{j}]",
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise OpenAIError(
                    f"{where}[{j}].function.arguments is not JSON: {short_repr(arguments)}",
                    param=f"{where}[{j}].function.arguments",
                ) from None
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or set(part) != {"type", "text"}
                or not isinstance(part["text"], str)
            ):
                raise OpenAIError(
                    f"messages[{i}].content[{j}]: only text parts "
                    f'({{"type": "text", "text": "..."}}) are supported, got {short_repr(part)}',
                    param=f"messages[{i}].content[{j}]",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise OpenAIError(
        f"messages[{i}].content must be a string or a list of text parts, got "
        f"{short_repr(content)}",
        param=f"messages[{i}].content",
    )
