"""Request and RequestStatus: the host-side state of one sequence being generated.

A Request is created by the engine, handed to ``Scheduler.add_request`` and from then on mutated
only by the scheduler (status, computed tokens, outputs) and the KV cache manager (block hashes).
Per-token work is O(1): outputs are appended to lists that are never copied.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxserve.structured.request_constraints import RequestConstraints


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Members from FINISHED_STOPPED on are terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Admitted, holding its blocks, while its KV loads from another engine (the KV connector,
    # asynchronously): scheduled in the first step after the load finished.
    WAITING_FOR_REMOTE_KVS = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    # Failed: the KV it was promised (kv_transfer_params) could not be loaded and
    # kv_load_failure_policy is "fail"; its stop_reason says why.
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """ "stop", "length" or "abort" for a terminal status, None otherwise."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence: its prompt, its outputs so far, and how much of it has KV in the cache.

    Token positions: ``all_token_ids[:num_computed_tokens]`` have their KV in the paged cache;
    ``all_token_ids[num_computed_tokens:]`` still have to be computed (the rest of a prompt, the
    last sampled token, or everything after a preemption). ``num_tokens - num_computed_tokens``
    is therefore 1 for a running decode.

    Steps in flight (scheduled, their results not yet learned): ``num_inflight_tokens`` of the
    request's tokens are being computed by them, and ``num_output_placeholders`` of its samples
    are being drawn by them, their ids unknown. Both are 0 between steps of a synchronous engine;
    with async scheduling, the next step is scheduled as if the request already had those
    tokens computed and those samples appended (docs/engine_step.md).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_ids",
        "arrival_time",
        "first_scheduled_time",
        "priority",
        "seed",
        "status",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "num_prompt_tokens",
        "block_hashes",
        "num_cached_tokens",
        "num_preemptions",
        "stop_reason",
        "max_num_tokens",
        "arrival_index",
        "parent_req_id",
        "stop_token_set",
        "spec_token_ids",
        "constraints",
        "num_inflight_tokens",
        "num_output_placeholders",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] | set[int] = frozenset(),
        arrival_time: float = 0.0,
        priority: int = 0,
        seed: int = 0,
        constraints: RequestConstraints | None = None,
    ) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"Request.request_id must be a str, got {request_id!r}")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(
                f"Request.sampling_params must be a SamplingParams, got {type(sampling_params)}"
            )
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)  # immutable after construction
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)  # may be empty (no EOS stop)
        self.arrival_time = arrival_time  # seconds, engine clock; FCFS order
        self.first_scheduled_time: float | None = None  # time.monotonic(); scheduler-owned
        self.priority = priority  # lower value is served first (priority policy)
        self.seed = seed  # resolved sampling seed; filled in by the engine
        self.status = RequestStatus.WAITING  # mutated by the scheduler only
        self.output_token_ids: list[int] = []  # appended by the scheduler, one per sample
        # prompt + outputs; the same ints as the two lists above, appended in step with outputs.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens with KV in the cache; scheduler-owned
        # Hash of each full block of all_token_ids, in logical order; extended lazily by the KV
        # cache manager (only for full blocks, only when prefix caching is on).
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = 0  # prefix-cache hits (tokens) at first schedule; scheduler-owned
        self.num_preemptions = 0  # times preempted (recompute); scheduler-owned
        self.stop_reason: int | str | None = None  # stop token id (or stop string) that ended it
        # Total tokens (prompt + outputs) at which generation stops with "length": the smallest of
        # prompt + max_tokens, max_model_len and what the KV pool can hold. Set by add_request.
        self.max_num_tokens = self.num_prompt_tokens + sampling_params.max_tokens
        self.arrival_index = -1  # set by Scheduler.add_request: tie-break among equal arrivals
        self.parent_req_id: str | None = None  # parallel sampling: the request to fork from
        # Token ids that end the request once min_tokens is reached: stop_token_ids, plus EOS
        # unless ignore_eos. Precomputed so the per-token stop check is one set lookup.
        self.stop_token_set = sampling_params.all_stop_token_ids
        if not sampling_params.ignore_eos:
            self.stop_token_set = self.stop_token_set | self.eos_token_ids
        # Speculative drafts for the tokens after all_token_ids, proposed after a step
        # (EngineCore) and consumed by the next schedule(): verified then, or dropped. Never
        # part of all_token_ids until the target accepts them.
        self.spec_token_ids: list[int] = []
        # Structured outputs and bad words: the per-step mask and the matcher that follows the
        # outputs (jaxserve/structured/); None for an unconstrained request.
        self.constraints = constraints
        # Steps in flight (class docstring): set by the scheduler's schedule(), given back by
        # its update_from_output() (or reset by a preemption).
        self.num_inflight_tokens = 0
        self.num_output_placeholders = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, token_id: int) -> RequestStatus | None:
        """Stop check after ``token_id`` was appended; returns the terminal status or None.

        Order: a stop token (``stop_token_ids``, then EOS unless ``ignore_eos``) ends it with
        "stop" once at least ``min_tokens`` outputs exist; otherwise reaching ``max_num_tokens``
        ends it with "length". Sets ``stop_reason`` for a stop token id (not for EOS).
        """
        if token_id in self.stop_token_set:
            params = self.sampling_params
            if len(self.output_token_ids) >= params.min_tokens:
                if token_id in params.all_stop_token_ids:
                    self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if len(self.all_token_ids) >= self.max_num_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_computed_tokens}/{self.num_tokens}, "
            f"outputs={self.num_output_tokens})"
        )
