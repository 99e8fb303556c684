"""The OpenAI API's bodies: requests parsed and validated into prompts and SamplingParams, error
bodies, and the response and stream-chunk bodies. Pure data: no web framework, no engine.

Every request field is declared (pydantic, ``extra="forbid"``): an unknown field is a 400 naming
it, never ignored. Fields of OpenAI's that jaxserve cannot honour (``tools``, ``logit_bias``,
``response_format``, ...) are refused with a 400 that says why, unless their value is the one
that changes nothing (``logit_bias: {}``, ``tool_choice: "none"``, ``best_of`` equal to ``n``).
Besides OpenAI's fields, every jaxserve SamplingParams field is accepted as an extra body field,
as vLLM accepts its own (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``prompt_logprobs``). Range checks are SamplingParams' own; its messages are passed on with the
request field's name.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from jaxserve.outputs import Logprob, PromptLogprobs, SampleLogprobs
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: an impossible token's logprob, as vLLM writes it
SSE_DONE = "data: [DONE]\n\n"

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error the API answers with: its HTTP status and OpenAI's error body (vLLM's style:
    ``{"error": {"message", "type", "param", "code"}}``, ``code`` the status)."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        param: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.type = error_type or _ERROR_TYPES.get(status_code, "APIError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status_code,
            }
        }


# ---- requests ---------------------------------------------------------------------------------
class _Body(BaseModel):
    # strict: no coercion ("1" is not a number, true is not an int), as OpenAI's API refuses them.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingRequest(_Body):
    """The fields both endpoints share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None  # str or list of str: SamplingParams checks it
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, it changes no output
    # jaxserve's SamplingParams fields, as vLLM's extra body fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: Any  # str, [str], [int] or [[int]]: completion_prompts checks it
    max_tokens: int | None = 16  # OpenAI's default; null: what the context leaves
    logprobs: int | None = None  # top-N per generated token
    echo: bool = False


class ChatMessage(_Body):
    role: str
    content: Any = None  # str or a list of text parts: chat_messages checks it
    name: str | None = None
    tool_call_id: str | None = None
    # What an assistant message of OpenAI's SDK carries, accepted when empty (chat_messages).
    tool_calls: Any = None
    function_call: Any = None
    refusal: Any = None


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # null: what the context leaves
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template: str | None = None  # vLLM's: a jinja2 template instead of the model's
    add_generation_prompt: bool = True


# Fields jaxserve cannot honour -> (the value that changes nothing, why not).
_NO_VALUE = object()
_REFUSED_COMMON = {
    "logit_bias": ({}, "no per-token logit bias in its sampler"),
}
_REFUSED_COMPLETION = {
    **_REFUSED_COMMON,
    "suffix": (_NO_VALUE, "no text insertion"),
}
_REFUSED_CHAT = {
    **_REFUSED_COMMON,
    "tools": ([], "no tool calling"),
    "tool_choice": ("none", "no tool calling"),
    "parallel_tool_calls": (_NO_VALUE, "no tool calling"),
    "functions": ([], "no function calling"),
    "function_call": ("none", "no function calling"),
    "response_format": ({"type": "text"}, "no structured (JSON) output"),
}


def parse_completion_request(body: Any) -> CompletionRequest:
    """A /v1/completions body -> CompletionRequest.

    Raises:
        OpenAIError (400): not an object, an unknown, refused or mistyped field (named).
    """
    request = _parse(CompletionRequest, body, _REFUSED_COMPLETION)
    assert isinstance(request, CompletionRequest)
    if request.echo and request.stream:
        raise OpenAIError(
            "echo=true is answered without streaming only; set stream to false", param="echo"
        )
    if request.max_tokens == 0 and not request.echo:
        raise OpenAIError(
            "max_tokens=0 asks for no completion: only with echo=true (the prompt's own "
            "logprobs); otherwise max_tokens must be >= 1",
            param="max_tokens",
        )
    return request


def echo_only(request: CompletionRequest) -> bool:
    """echo with max_tokens=0: the prompt (and its logprobs) alone, as OpenAI's completions
    API scored prompts. The engine still samples one token, which the answer leaves out."""
    return request.echo and request.max_tokens == 0


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """A /v1/chat/completions body -> ChatCompletionRequest.

    Raises:
        OpenAIError (400): as parse_completion_request; max_tokens and max_completion_tokens
            both given and different; top_logprobs without logprobs=true.
    """
    request = _parse(ChatCompletionRequest, body, _REFUSED_CHAT)
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


def _parse(model: type[_SamplingRequest], body: Any, refused: dict[str, Any]) -> _SamplingRequest:
    if not isinstance(body, dict):
        raise OpenAIError(f"the request body must be a JSON object, got {type(body).__name__}")
    body = dict(body)
    best_of = body.pop("best_of", None)
    if best_of is not None and best_of != body.get("n", 1):
        raise OpenAIError(
            f"best_of={best_of!r} is not supported: jaxserve returns every sample, so best_of "
            f"must be null or equal to n ({body.get('n', 1)!r})",
            param="best_of",
        )
    for name, (neutral, why) in refused.items():
        if name not in body:
            continue
        value = body.pop(name)
        if value is not None and value != neutral:
            raise OpenAIError(
                f"{name} is not supported by jaxserve ({why}); got {_short(value)}", param=name
            )
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    if request.stream_options is not None and not request.stream:
        raise OpenAIError("stream_options is only allowed with stream=true", param="stream_options")
    if request.stream and request.prompt_logprobs is not None:
        raise OpenAIError(
            "prompt_logprobs is not available with stream=true", param="prompt_logprobs"
        )
    return request


def _validation_error(e: ValidationError) -> OpenAIError:
    error = e.errors()[0]
    param = loc_path(error["loc"])
    if error["type"] == "extra_forbidden":
        message = f"unknown field {param!r}: not a field of this endpoint (OpenAI's or jaxserve's)"
    elif error["type"] == "missing":
        message = f"field {param!r} is required"
    else:
        message = f"{param}: {error['msg']}, got {_short(error.get('input'))}"
    return OpenAIError(message, param=param)


def loc_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """A pydantic error location as a field path: ('messages', 0, 'role') -> messages[0].role."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: one str or token-id list each.

    Raises:
        OpenAIError (400, param "prompt"): not a str, [str], [int] or [[int]], or an empty list.
    """
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token_id(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise OpenAIError(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
        f"token ids (non-empty), got {_short(prompt)}",
        param="prompt",
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it: role, content (text parts joined with a
    newline, as vLLM does), name and tool_call_id when given.

    Raises:
        OpenAIError (400): content that is not text, a message with tool or function calls.
    """
    messages = []
    for i, message in enumerate(request.messages):
        for name in ("tool_calls", "function_call", "refusal"):
            if getattr(message, name) not in (None, []):
                raise OpenAIError(
                    f"messages[{i}].{name} is not supported (jaxserve does no tool calling)",
                    param=f"messages[{i}].{name}",
                )
        out: dict[str, Any] = {"role": message.role, "content": _message_text(i, message.content)}
        if message.name is not None:
            out["name"] = message.name
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        messages.append(out)
    return messages


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
                    f'({{"type": "text", "text": "..."}}) are supported, got {_short(part)}',
                    param=f"messages[{i}].content[{j}]",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise OpenAIError(
        f"messages[{i}].content must be a string or a list of text parts, got {_short(content)}",
        param=f"messages[{i}].content",
    )


# Request fields passed to SamplingParams under the same name, when not null.
_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "prompt_logprobs",
)


def requested_max_tokens(
    request: CompletionRequest | ChatCompletionRequest,
) -> tuple[int | None, str]:
    """(the completion-length limit the request gives or None, the field that gives it)."""
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens, "max_completion_tokens"
    return request.max_tokens, "max_tokens"


def num_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Top-N logprobs per generated token the request asks for (None: no logprobs)."""
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    output_kind: RequestOutputKind,
) -> SamplingParams:
    """The request's SamplingParams; absent fields take SamplingParams' defaults.

    Raises:
        OpenAIError (400): SamplingParams refused a value; param is the request's field.
    """
    fields = {name: getattr(request, name) for name in _SAMPLING_FIELDS}
    fields = {k: v for k, v in fields.items() if v is not None}
    fields["logprobs"] = num_logprobs(request)
    fields["max_tokens"] = max_tokens
    with translate_params_errors(request):
        return SamplingParams(**fields, output_kind=output_kind)


def with_max_tokens(
    request: CompletionRequest | ChatCompletionRequest, params: SamplingParams, max_tokens: int
) -> SamplingParams:
    """``params`` with another max_tokens (validated again)."""
    if params.max_tokens == max_tokens:
        return params
    with translate_params_errors(request):
        return replace(params, max_tokens=max_tokens)


@contextlib.contextmanager
def translate_params_errors(
    request: CompletionRequest | ChatCompletionRequest,
) -> Iterator[None]:
    """SamplingParams' TypeError / ValueError -> OpenAIError (400) naming the request's field."""
    names = {"max_tokens": requested_max_tokens(request)[1]}
    if isinstance(request, ChatCompletionRequest):
        names["logprobs"] = "top_logprobs"
    try:
        yield
    except (TypeError, ValueError) as e:
        message = str(e)
        match = re.match(r"SamplingParams\.(\w+)", message)
        if match is None:
            raise OpenAIError(message) from None
        param = names.get(match.group(1), match.group(1))
        raise OpenAIError(param + message[match.end() :], param=param) from None


# ---- responses ---------------------------------------------------------------------------------
def finite(logprob: float) -> float:
    """A logprob JSON can carry (-inf -> LOGPROB_FLOOR; NaN, which should not occur, too)."""
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_text(token_id: int, logprob: Logprob, tokenizer: Any) -> str:
    """A token's text: the engine's decoding, else the tokenizer's, else "token_id:N"."""
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    if tokenizer is not None:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    return f"token_id:{token_id}"


def _top(position: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The ``num`` most likely tokens of a position (the sampled one only if it is among them)."""
    ranked = sorted(position.items(), key=lambda kv: math.inf if kv[1].rank is None else kv[1].rank)
    return ranked[:num]


def completion_logprobs(
    logprobs: SampleLogprobs, num_top: int, tokenizer: Any, text_offset: int = 0
) -> dict[str, list[Any]]:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs (the
    ``num_top`` most likely tokens per position) and text_offset (from ``text_offset``)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for position in logprobs:
        token_id, sampled = next(iter(position.items()))  # the sampled token comes first
        token = token_text(token_id, sampled, tokenizer)
        tokens.append(token)
        token_logprobs.append(finite(sampled.logprob))
        top_logprobs.append(
            {token_text(t, lp, tokenizer): finite(lp.logprob) for t, lp in _top(position, num_top)}
        )
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def echo_logprobs(
    prompt_token_ids: list[int],
    prompt_logprobs: PromptLogprobs,
    num_top: int,
    tokenizer: Any,
) -> dict[str, list[Any]]:
    """The completions logprobs object of an echoed prompt: its first token has none (null
    token_logprobs and top_logprobs, as OpenAI's), each later one its own logprob and top-N."""
    first = prompt_token_ids[0]
    first_text = tokenizer.decode([first], skip_special_tokens=False) if tokenizer else None
    rest = completion_logprobs(
        [
            _ordered(position, token)
            for position, token in zip(prompt_logprobs[1:], prompt_token_ids[1:], strict=True)
        ],
        num_top,
        tokenizer,
        len(first_text or f"token_id:{first}"),
    )
    return {
        "tokens": [first_text or f"token_id:{first}", *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def _ordered(position: dict[int, Logprob], token_id: int) -> dict[int, Logprob]:
    """A prompt position's logprobs with its own token first (as a sampled position has)."""
    return {token_id: position[token_id], **position}


def chat_logprobs(logprobs: SampleLogprobs, num_top: int, tokenizer: Any) -> dict[str, Any]:
    """The chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for position in logprobs:
        token_id, sampled = next(iter(position.items()))
        entry = _chat_token(token_text(token_id, sampled, tokenizer), sampled.logprob)
        entry["top_logprobs"] = [
            _chat_token(token_text(t, lp, tokenizer), lp.logprob)
            for t, lp in _top(position, num_top)
        ]
        content.append(entry)
    return {"content": content}


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": finite(logprob), "bytes": list(token.encode("utf-8"))}


def prompt_logprobs_body(prompt_logprobs: PromptLogprobs | None) -> list[Any] | None:
    """vLLM's prompt_logprobs: per prompt token null (the first) or {token_id: {logprob, rank,
    decoded_token}} (JSON object keys are strings)."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            str(t): {
                "logprob": finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for t, lp in position.items()
        }
        for position in prompt_logprobs
    ]


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"
