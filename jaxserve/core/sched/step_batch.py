"""StepBatch: what one ``Scheduler.schedule()`` call has decided so far.

The scheduler fills it in passes (running requests, waiting ones, then the running requests'
speculative drafts) and turns it into the SchedulerOutput hand-off at the end. Keeping new and
running requests in separate containers gives the batch order the runner relies on (new
requests first, then running ones) without sorting.
"""

from __future__ import annotations

from jaxserve.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.request import Request


class StepBatch:
    """Accumulator of one step; owned by the scheduler for the duration of schedule()."""

    __slots__ = (
        "max_budget",
        "budget",
        "new_reqs",
        "new_tokens",
        "cached_reqs",
        "cached_tokens",
        "preempted_req_ids",
        "live_tokens",
        "num_blocks",
        "spec_tokens",
        "num_draft_tokens",
        "_cached_by_id",
    )

    def __init__(self, budget: int) -> None:
        self.max_budget = budget  # max_num_batched_tokens of the step
        self.budget = budget  # tokens still free in this step
        self.new_reqs: list[NewRequestData] = []
        self.new_tokens: dict[str, int] = {}  # req_id -> scheduled tokens, new requests
        self.cached_reqs: list[CachedRequestData] = []
        self.cached_tokens: dict[str, int] = {}  # req_id -> scheduled tokens, running requests
        self.preempted_req_ids: set[str] = set()
        # Sums over the scheduled requests: tokens whose KV is in the cache once this step ran
        # (num_computed + scheduled), and blocks in their tables.
        self.live_tokens = 0
        self.num_blocks = 0
        self.spec_tokens: dict[str, list[int]] = {}  # req_id -> drafts verified this step
        self.num_draft_tokens = 0  # their total: each takes a sampling row of the step
        self._cached_by_id: dict[str, CachedRequestData] = {}

    def add_new(self, req: Request, block_ids: list[int], num_new: int) -> None:
        """Schedule ``num_new`` tokens of an admitted request from its num_computed_tokens
        (the runner gets it whole, as a new request)."""
        num_computed = req.num_computed_tokens
        _mark_in_flight(req, num_computed, num_new)
        self.new_reqs.append(
            NewRequestData(
                req.request_id,
                list(req.all_token_ids),
                req.num_prompt_tokens,
                req.sampling_params,
                block_ids,
                num_computed,
                req.seed,
            )
        )
        self.new_tokens[req.request_id] = num_new
        self.budget -= num_new
        self.live_tokens += num_computed + num_new
        self.num_blocks += len(block_ids)

    def add_cached(
        self, req: Request, new_block_ids: list[int], num_new: int, num_blocks: int
    ) -> None:
        """Schedule ``num_new`` tokens of a running request from its num_computed_tokens; its
        table now holds ``num_blocks`` blocks, the last ``new_block_ids`` of them new this
        step. Tokens of the request still in flight count as computed."""
        rid, num_computed = req.request_id, req.num_computed_tokens + req.num_inflight_tokens
        _mark_in_flight(req, num_computed, num_new)
        data = CachedRequestData(rid, new_block_ids, num_computed)
        self.cached_reqs.append(data)
        self._cached_by_id[rid] = data
        self.cached_tokens[rid] = num_new
        self.budget -= num_new
        self.live_tokens += num_computed + num_new
        self.num_blocks += num_blocks

    def add_drafts(self, req: Request, drafts: list[int], new_block_ids: list[int]) -> None:
        """Verify speculative ``drafts`` after the tokens scheduled for the running request
        ``req`` (add_cached); its table grew by ``new_block_ids`` for them."""
        req_id = req.request_id
        req.num_inflight_tokens += len(drafts)
        self.spec_tokens[req_id] = drafts
        self.num_draft_tokens += len(drafts)
        self.cached_tokens[req_id] += len(drafts)
        self.budget -= len(drafts)
        self.live_tokens += len(drafts)
        self._cached_by_id[req_id].new_block_ids.extend(new_block_ids)
        self.num_blocks += len(new_block_ids)

    @property
    def num_sampling_rows(self) -> int:
        """Logits rows the step samples so far: one per scheduled request, one per draft."""
        return len(self.new_tokens) + len(self.cached_tokens) + self.num_draft_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        return self.max_budget - self.budget

    def slot_utilization(self, block_size: int) -> float:
        """Live tokens / allocated KV slots of the scheduled requests (0 if none)."""
        slots = self.num_blocks * block_size
        return self.live_tokens / slots if slots else 0.0

    def to_output(
        self,
        finished_req_ids: set[str],
        block_copies: list[tuple[int, int]],
        host_copies: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], []),
    ) -> SchedulerOutput:
        # Batch order: new requests first, then running ones, as in the two lists.
        num_scheduled = self.new_tokens
        if num_scheduled:
            num_scheduled.update(self.cached_tokens)
        else:
            num_scheduled = self.cached_tokens
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=self.cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.num_scheduled_tokens,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
            block_copies=block_copies,
            device_to_host=host_copies[0],
            host_to_device=host_copies[1],
            scheduled_spec_decode_tokens=self.spec_tokens,
        )


def _mark_in_flight(req: Request, num_computed: int, num_new: int) -> None:
    """The request's ``num_new`` tokens from ``num_computed`` are in flight from now on, and,
    when they reach its last token (placeholders included), so is one more sample: the next
    step may be scheduled before this one's results are learned (Request's docstring)."""
    req.num_inflight_tokens += num_new
    if num_computed + num_new >= len(req.all_token_ids) + req.num_output_placeholders:
        req.num_output_placeholders += 1
