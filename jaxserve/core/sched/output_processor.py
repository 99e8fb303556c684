"""Turning a ModelRunnerOutput into EngineCoreOutputs: advance computed tokens, append samples,
check stops, pass logprobs through. Pure functions over the scheduler's request map; the
scheduler frees what finished."""

from __future__ import annotations

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.core.sched.spec_tokens import SpecDecodeStats, computed_counts
from jaxserve.outputs import EngineCoreOutput, ModelRunnerOutput
from jaxserve.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING


def process_step(
    requests: dict[str, Request],
    scheduler_output: SchedulerOutput,
    runner_output: ModelRunnerOutput,
    kv: KVCacheManager | None,
    spec_stats: SpecDecodeStats | None,
) -> tuple[list[EngineCoreOutput], list[Request]]:
    """A step's results on the requests: computed tokens advance (less rejected drafts),
    samples are appended and stops checked, newly full blocks enter the prefix cache (``kv``,
    when prefix caching is on) once their tokens are known, prompt logprobs ride along.

    Returns:
        (one EngineCoreOutput per request that sampled or got prompt logprobs, the requests
        that finished; the caller frees them).
    """
    num_computed = scheduler_output.num_scheduled_tokens
    spec = scheduler_output.scheduled_spec_decode_tokens
    if spec:  # rejected drafts are not computed: rolled back before any block is hashed
        num_computed = computed_counts(num_computed, spec, runner_output, spec_stats)
    crossed = advance_computed(requests, scheduler_output.num_scheduled_tokens, num_computed,
                               kv.block_size if kv is not None else 0)  # fmt: skip
    outputs, finished = append_samples(requests, runner_output)
    if kv is not None:
        for req in crossed:
            kv.cache_blocks(req)
    if runner_output.prompt_logprobs:
        attach_prompt_logprobs(requests, runner_output, outputs)
    return outputs, finished


def advance_computed(
    requests: dict[str, Request],
    num_scheduled: dict[str, int],
    num_computed: dict[str, int],
    block_size: int,
) -> list[Request]:
    """Count a step's computed tokens (requests gone since are skipped); the step is no longer
    in flight: its scheduled tokens, and its sample for a request it ran to the end of, leave
    the request's in-flight counts. Returns the requests a block of which just became full
    (none for ``block_size`` 0): the caller hashes those into the prefix cache once the step's
    tokens are appended (a block is hashed from its tokens)."""
    crossed = []
    for rid, num in num_computed.items():
        req = requests.get(rid)
        if req is None or req.status is not _RUNNING:
            continue
        old = req.num_computed_tokens
        req.num_computed_tokens = old + num
        req.num_inflight_tokens -= num_scheduled[rid]
        if old + num >= len(req.all_token_ids):  # it sampled: append_samples learns the id
            req.num_output_placeholders -= 1
        if block_size and (old + num) // block_size != old // block_size:
            crossed.append(req)
    return crossed


def finished_output(req: Request) -> EngineCoreOutput:
    """The output of a request ended outside a step (an abort, a stop string): no new tokens,
    its status's finish reason."""
    return EngineCoreOutput(
        req.request_id,
        [],
        finish_reason=req.status.finish_reason,
        stop_reason=req.stop_reason,
        num_cached_tokens=req.num_cached_tokens,
    )


def append_samples(
    requests: dict[str, Request], model_runner_output: ModelRunnerOutput
) -> tuple[list[EngineCoreOutput], list[Request]]:
    """Append each running request's samples and check its stops.

    Requests gone since the step was scheduled are skipped; a sample for a request whose tokens
    are not all computed (mid-prefill) is discarded. A request that stops gets its terminal
    status here; the caller frees it.

    Returns:
        (one EngineCoreOutput per request that sampled, the requests that finished).
    """
    logprobs = model_runner_output.logprobs
    outputs: list[EngineCoreOutput] = []
    finished: list[Request] = []
    for rid, token_ids in zip(
        model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True
    ):
        req = requests.get(rid)
        if req is None or req.status is not _RUNNING:
            continue
        all_ids = req.all_token_ids
        if req.num_computed_tokens < len(all_ids):
            continue
        status = None
        if len(token_ids) == 1:  # the common case, inlined
            token_id = token_ids[0]
            req.output_token_ids.append(token_id)
            all_ids.append(token_id)
            if token_id in req.stop_token_set or len(all_ids) >= req.max_num_tokens:
                status = req.check_stop(token_id)
        else:
            token_ids, status = _append_tokens(req, token_ids)
        new_logprobs = logprobs.get(rid) if logprobs else None
        if status is None:
            outputs.append(
                EngineCoreOutput(
                    rid, token_ids, new_logprobs, None, None, None, req.num_cached_tokens
                )
            )
            continue
        if new_logprobs is not None:
            new_logprobs = new_logprobs[: len(token_ids)]
        req.status = status
        finished.append(req)
        outputs.append(
            EngineCoreOutput(
                rid,
                token_ids,
                new_logprobs,
                None,
                status.finish_reason,
                req.stop_reason,
                req.num_cached_tokens,
            )
        )
    return outputs, finished


def _append_tokens(req: Request, token_ids: list[int]) -> tuple[list[int], RequestStatus | None]:
    """Append several samples (accepted speculative drafts and one more), stopping at the first
    stop; returns the tokens kept and the terminal status, if any. A stop inside the run drops
    the tokens after it, and the computed count with them (nothing past a stop is cached)."""
    for i, token_id in enumerate(token_ids):
        req.append_output_token_id(token_id)
        status = req.check_stop(token_id)
        if status is not None:
            last = len(req.all_token_ids) - 1
            if req.num_computed_tokens > last:
                req.num_computed_tokens = last
            return token_ids[: i + 1], status
    return token_ids, None


def attach_prompt_logprobs(
    requests: dict[str, Request],
    model_runner_output: ModelRunnerOutput,
    outputs: list[EngineCoreOutput],
) -> None:
    """Put prompt logprobs on the request's output of this step, or on a new token-less one
    (a request in mid-prefill samples nothing but still gets its prompt logprobs)."""
    by_id = {out.req_id: out for out in outputs}
    for rid, prompt_logprobs in model_runner_output.prompt_logprobs.items():
        out = by_id.get(rid)
        if out is not None:
            out.new_prompt_logprobs = prompt_logprobs
            continue
        req = requests.get(rid)
        if req is not None:
            outputs.append(
                EngineCoreOutput(
                    rid,
                    [],
                    new_prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
