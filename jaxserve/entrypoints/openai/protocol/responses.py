"""The response bodies' shared pieces: logprobs objects (completions', chat's, vLLM's
prompt_logprobs), usage, and server-sent events."""

from __future__ import annotations

import json
import math
from typing import Any

from jaxserve.outputs import Logprob, PromptLogprobs, SampleLogprobs

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: an impossible token's logprob, as vLLM writes it
SSE_DONE = "data: [DONE]\n\n"


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
