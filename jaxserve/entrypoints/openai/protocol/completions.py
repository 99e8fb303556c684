"""POST /v1/completions: the request model, its checks and its prompts."""

from __future__ import annotations

from typing import Any

from jaxserve.entrypoints.openai.protocol.errors import OpenAIError, short_repr
from jaxserve.entrypoints.openai.protocol.fields import (
    NO_VALUE,
    REFUSED_COMMON,
    SamplingRequest,
    parse_request,
)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: Any  # str, [str], [int] or [[int]]: completion_prompts checks it
    max_tokens: int | None = 16  # OpenAI's default; null: what the context leaves
    logprobs: int | None = None  # top-N per generated token
    echo: bool = False


_REFUSED_COMPLETION = {
    **REFUSED_COMMON,
    "suffix": (NO_VALUE, "no text insertion"),
}


def parse_completion_request(body: Any) -> CompletionRequest:
    """A /v1/completions body -> CompletionRequest.

    Raises:
        OpenAIError (400): not an object, an unknown, refused or mistyped field (named).
    """
    request = parse_request(CompletionRequest, body, _REFUSED_COMPLETION)
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
        f"token ids (non-empty), got {short_repr(prompt)}",
        param="prompt",
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
