"""What a request must satisfy before the scheduler queues it, and where its generation ends.

Checked before anything is allocated (docs/architecture.md): a request that fails raises a
ValueError naming the numbers, and the scheduler is left exactly as it was.
"""

from __future__ import annotations

from jaxserve.request import Request, RequestStatus


def validate_request(
    request: Request,
    parent_req_id: str | None,
    requests: dict[str, Request],
    max_model_len: int,
    block_size: int,
    num_usable_blocks: int,
) -> None:
    """Raise ValueError unless ``request`` can ever be served (TypeError if not a Request).

    Args:
        request: the new request (must be fresh: WAITING, nothing computed or generated).
        parent_req_id: for a parallel-sampling child, the unfinished request with the same
            prompt whose prompt KV it will borrow.
        requests: the scheduler's unfinished requests by id (ids must be unique among them).
        max_model_len: the longest prompt allowed (generation is capped, not rejected).
        block_size / num_usable_blocks: the KV pool; the prompt alone must fit in it.
    """
    if not isinstance(request, Request):
        raise TypeError(f"add_request expects a Request, got {type(request).__name__}")
    rid = request.request_id
    if rid in requests:
        raise ValueError(f"request_id {rid!r} is already in use by an unfinished request")
    if (
        request.status != RequestStatus.WAITING
        or request.num_computed_tokens
        or request.output_token_ids
    ):
        raise ValueError(f"request {rid!r} is not fresh (status {request.status.name})")
    num_prompt = request.num_prompt_tokens
    try:
        check_prompt_length(num_prompt, max_model_len, block_size, num_usable_blocks)
    except ValueError as e:
        raise ValueError(f"request {rid!r}: {e}") from None
    if parent_req_id is None:
        return
    parent = requests.get(parent_req_id)
    if parent is None:
        raise ValueError(f"request {rid!r}: parent {parent_req_id!r} is not an unfinished request")
    if parent.prompt_token_ids != request.prompt_token_ids:
        raise ValueError(
            f"request {rid!r}: prompt ({num_prompt} tokens) differs from that of its parent "
            f"{parent.request_id!r} ({parent.num_prompt_tokens} tokens)"
        )


def check_prompt_length(
    num_prompt: int, max_model_len: int, block_size: int, num_usable_blocks: int
) -> None:
    """Raise ValueError (naming the numbers) unless a prompt of ``num_prompt`` tokens can ever
    be served: at least one token, at most max_model_len, and fitting the whole KV pool."""
    if num_prompt == 0:
        raise ValueError("the prompt is empty (0 tokens); need >= 1")
    if num_prompt > max_model_len:
        raise ValueError(f"prompt has {num_prompt} tokens, more than max_model_len={max_model_len}")
    num_blocks = -(-num_prompt // block_size)
    if num_blocks > num_usable_blocks:
        raise ValueError(
            f"prompt of {num_prompt} tokens needs {num_blocks} KV blocks of {block_size} "
            f"tokens, but the pool has only {num_usable_blocks} usable blocks"
        )


def generation_limit(
    request: Request, max_model_len: int, block_size: int, num_usable_blocks: int
) -> int:
    """Total tokens (prompt + outputs) at which the request ends with finish_reason "length".

    The smallest of prompt + max_tokens, max_model_len, and what the pool can hold for this
    request alone (every token but the last sampled one needs a KV slot) — the last cap keeps a
    request that outgrows the pool from preempting itself forever. Always allows >= 1 output.
    """
    num_prompt = request.num_prompt_tokens
    limit = min(
        num_prompt + request.sampling_params.max_tokens,
        max_model_len,
        num_usable_blocks * block_size + 1,
    )
    return max(limit, num_prompt + 1)
