"""A request's SamplingParams: the fields passed on by name, the completion length, and
SamplingParams' errors renamed to the request's field (its range checks are its own)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import replace

from jaxserve.entrypoints.openai.protocol.chat import ChatCompletionRequest
from jaxserve.entrypoints.openai.protocol.completions import CompletionRequest
from jaxserve.entrypoints.openai.protocol.constraints import constraint_fields, constraint_source
from jaxserve.entrypoints.openai.protocol.errors import OpenAIError
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

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
    "kv_transfer_params",
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
    tool_constraint: dict | None = None,
) -> SamplingParams:
    """The request's SamplingParams; absent fields take SamplingParams' defaults.

    Args:
        tool_constraint: the structured_outputs a tool_choice forces (tools.py), or None.

    Raises:
        OpenAIError (400): SamplingParams refused a value; param is the request's field.
    """
    fields = {name: getattr(request, name) for name in _SAMPLING_FIELDS}
    fields = {k: v for k, v in fields.items() if v is not None}
    fields["logprobs"] = num_logprobs(request)
    fields["max_tokens"] = max_tokens
    with translate_params_errors(request):
        fields.update(constraint_fields(request, tool_constraint))
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
    names = {
        "max_tokens": requested_max_tokens(request)[1],
        "structured_outputs": constraint_source(request),
    }
    if isinstance(request, ChatCompletionRequest):
        names["logprobs"] = "top_logprobs"
    try:
        yield
    except (TypeError, ValueError) as e:
        message = str(e)
        match = re.match(r"SamplingParams\.(\w+)", message)
        if match is None:  # StructuredOutputsParams' own checks: the constraint's field
            match = re.match(r"StructuredOutputsParams(?=[.:])", message)
            if match is None:
                raise OpenAIError(message) from None
            param = names["structured_outputs"]
        else:
            param = names.get(match.group(1), match.group(1))
        raise OpenAIError(param + message[match.end() :], param=param) from None
