"""The request fields both endpoints share, the fields refused on both, and the parsing of a
body into a request model: every field declared (``extra="forbid"``, strict types), a refused
field a 400 that says why unless its value is the one that changes nothing."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from jaxserve.entrypoints.openai.protocol.errors import OpenAIError, loc_path, short_repr


class StrictBody(BaseModel):
    # strict: no coercion ("1" is not a number, true is not an int), as OpenAI's API refuses them.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictBody):
    include_usage: bool = False


class SamplingRequest(StrictBody):
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
    # What may be sampled (constraints.py): OpenAI's, then vLLM's extra body fields.
    response_format: Any = None
    logit_bias: Any = None
    structured_outputs: Any = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's disaggregated serving: what the request expects of the KV connector
    # (SamplingParams.kv_transfer_params checks the keys).
    kv_transfer_params: Any = None


# Fields jaxserve cannot honour -> (the value that changes nothing, why not).
NO_VALUE = object()
REFUSED_COMMON: dict[str, tuple[Any, str]] = {}


def parse_request(
    model: type[SamplingRequest], body: Any, refused: dict[str, Any]
) -> SamplingRequest:
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
                f"{name} is not supported by jaxserve ({why}); got {short_repr(value)}", param=name
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
        message = f"{param}: {error['msg']}, got {short_repr(error.get('input'))}"
    return OpenAIError(message, param=param)
