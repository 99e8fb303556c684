"""The OpenAI API's bodies: requests parsed and validated into prompts and SamplingParams, error
bodies, and the response and stream-chunk bodies. Pure data: no web framework, no engine.

Every request field is declared (pydantic, ``extra="forbid"``): an unknown field is a 400 naming
it, never ignored. Fields of OpenAI's that jaxserve cannot honour (``suffix``, ``functions``,
...) are refused with a 400 that says why, unless their value is the one that changes nothing
(``best_of`` equal to ``n``). ``response_format``, ``logit_bias`` and vLLM's
``structured_outputs``, ``allowed_token_ids`` and ``bad_words`` constrain the sampling
(constraints.py); ``tools`` and ``tool_choice`` are checked in tools.py.
Besides OpenAI's fields, every jaxserve SamplingParams field is accepted as an extra body field,
as vLLM accepts its own (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``prompt_logprobs``). Range checks are SamplingParams' own; its messages are passed on with the
request field's name.

The rooms: errors.py (OpenAIError, loc_path), fields.py (the fields both endpoints share, the
parsing), completions.py and chat.py (each endpoint's request and its checks), sampling.py (a
request's SamplingParams), constraints.py (what may be sampled), tools.py (tool choice),
responses.py (logprobs, usage and stream-chunk pieces).
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.protocol.chat import (
    ChatCompletionRequest,
    ChatMessage,
    chat_messages,
    parse_chat_request,
)
from jaxserve.entrypoints.openai.protocol.completions import (
    CompletionRequest,
    completion_prompts,
    echo_only,
    parse_completion_request,
)
from jaxserve.entrypoints.openai.protocol.errors import OpenAIError, loc_path
from jaxserve.entrypoints.openai.protocol.fields import StreamOptions
from jaxserve.entrypoints.openai.protocol.responses import (
    LOGPROB_FLOOR,
    SSE_DONE,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    finite,
    prompt_logprobs_body,
    sse,
    token_text,
    usage,
)
from jaxserve.entrypoints.openai.protocol.sampling import (
    num_logprobs,
    requested_max_tokens,
    sampling_params,
    translate_params_errors,
    with_max_tokens,
)

__all__ = [
    "LOGPROB_FLOOR",
    "SSE_DONE",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "OpenAIError",
    "StreamOptions",
    "chat_logprobs",
    "chat_messages",
    "completion_logprobs",
    "completion_prompts",
    "echo_logprobs",
    "echo_only",
    "finite",
    "loc_path",
    "num_logprobs",
    "parse_chat_request",
    "parse_completion_request",
    "prompt_logprobs_body",
    "requested_max_tokens",
    "sampling_params",
    "sse",
    "token_text",
    "translate_params_errors",
    "usage",
    "with_max_tokens",
]
