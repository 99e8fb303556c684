"""Scheduler: token-budget continuous batching with chunked prefill, prefix caching (device
and host tiers) and preemption by recompute or swap (docs/architecture.md).

No prefill or decode phase: each ``schedule()`` hands out ``max_num_batched_tokens`` so that
requests catch up (``num_computed_tokens`` towards ``num_tokens``, plus speculative drafts),
running requests first in policy order, then waiting ones; ``update_from_output`` appends the
samples, checks stops and frees finished requests. Parallel sampling (n > 1): child requests
(``add_request(child, parent_req_id=...)``) wait for the parent's prompt, then borrow its blocks
(copy-on-write for the one they write) and compute only the last prompt token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.host_block_pool import HostTier
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_cache_utils import KVCacheBlock
from jaxserve.core.kv_connector.base import KVConnector
from jaxserve.core.sched.admission import (
    check_prompt_length,
    generation_limit,
    validate_request,
)
from jaxserve.core.sched.host_kv_tier import HostKVTier
from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.core.sched.output_processor import finished_output, process_step
from jaxserve.core.sched.policy import make_policy
from jaxserve.core.sched.remote_kv import RemoteKV
from jaxserve.core.sched.spec_tokens import SpecDecodeStats, lookahead_slots, schedule_drafts
from jaxserve.core.sched.stats import SchedulerStats, carry_kv_counters
from jaxserve.core.sched.step_batch import StepBatch
from jaxserve.core.sched.step_cap import StepTokenCap
from jaxserve.core.sched.waiting import schedule_loaded, schedule_waiting
from jaxserve.outputs import EngineCoreOutput, ModelRunnerOutput
from jaxserve.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING
_LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS


class Scheduler:
    """Decides, step by step, which tokens of which requests the runner computes.

    Args:
        scheduler_config: token budget, max sequences per step, max_model_len, policy.
        cache_config: block size and prefix caching.
        num_kv_blocks: size of the device KV pool in blocks, including the null block 0.
        host_tier: the runner's host KV tier, or None; required (with num_blocks > 0) when
            cache_config.kv_offloading_size > 0.
        num_speculative_tokens: k of speculative decoding (0: off): up to k drafts a request
            (Request.spec_token_ids), verified in its next step (spec_tokens.py).
        num_lookahead_tokens: KV slots reserved past the known tokens of a request whose chunk
            reaches them, for a draft model's proposals (0: none).
        max_num_sampling_rows: logits rows a step may sample, one per request and per draft
            (the runner's row cap; default, and at least, max_num_seqs).
        kv_connector: the KV connector's scheduler half (core/kv_connector/), or None.
        token_cap: caps each step's token budget while a server's warm-up goes on
            (step_cap.py); None: the budget is max_num_batched_tokens.

    Requests live in ``requests`` from add_request until they finish; a request is in exactly
    one of ``waiting`` (WAITING or PREEMPTED), ``running`` (RUNNING, sorted by policy key) and
    ``remote.loading`` (WAITING_FOR_REMOTE_KVS: holding its blocks while its KV loads from
    another engine, remote_kv.py).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        host_tier: HostTier | None = None,
        num_speculative_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        max_num_sampling_rows: int | None = None,
        kv_connector: KVConnector | None = None,
        token_cap: StepTokenCap | None = None,
    ) -> None:
        self.host = HostKVTier(cache_config, host_tier)
        self.kv_connector = kv_connector  # core/kv_connector/: KV shared with other engines
        self.remote = RemoteKV(kv_connector, cache_config.block_size)
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.token_cap = token_cap
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.num_kv_blocks = num_kv_blocks
        self.kv_cache_manager = self._new_kv_cache_manager()
        self.num_usable_blocks = num_kv_blocks - 1
        self.policy = scheduler_config.policy
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting, self.sort_key = make_policy(scheduler_config.policy)
        self.running: list[Request] = []  # sorted by sort_key: the last one is preempted first
        self._finished_req_ids: set[str] = set()  # since the last schedule(); for the runner
        self._failed_outputs: list[EngineCoreOutput] = []  # ended in schedule(); told next
        self._num_added = 0  # arrival_index of the next request
        self.stats = SchedulerStats()
        k = num_speculative_tokens
        self.spec_stats = SpecDecodeStats(k) if k else None  # counters of verified drafts
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_num_sampling_rows = max(max_num_sampling_rows or 0, self.max_num_seqs)
        self._max_step_tokens: Callable[[int], int] | None = None  # set_spec_tokens' cap

    # ----------------------------------------------------------------------------- requests

    def add_request(self, request: Request, parent_req_id: str | None = None) -> None:
        """Validate and queue a request; nothing is allocated until it is scheduled.

        Args:
            request: a fresh Request (status WAITING, nothing computed).
            parent_req_id: parallel sampling: an unfinished request with the same prompt whose
                prompt KV this one borrows once it is computed.

        Raises:
            ValueError (naming the numbers) for an empty prompt, a prompt longer than
            max_model_len or than the whole KV pool holds, a duplicate id, or a bad parent.
            TypeError if ``request`` is not a Request.
        """
        if not isinstance(request, Request):
            raise TypeError(f"add_request expects a Request, got {type(request).__name__}")
        limits = (self.max_model_len, self.block_size, self.num_usable_blocks)
        validate_request(request, parent_req_id, self.requests, *limits)
        request.max_num_tokens = generation_limit(request, *limits)
        request.arrival_index = self._num_added
        request.parent_req_id = parent_req_id
        self._num_added += 1
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def set_spec_tokens(
        self,
        drafts: dict[str, list[int]],
        max_step_tokens: Callable[[int], int] | None = None,
    ) -> None:
        """Drafts for running requests, verified next step as far as they fit (spec_tokens);
        ``max_step_tokens(n)``, when given: the most tokens the next step may reach with its
        drafts when its other tokens number n (e.g. the bucket n pads to)."""
        self._max_step_tokens = max_step_tokens
        for req_id, draft_ids in drafts.items():
            req = self.requests.get(req_id)
            if req is not None and req.status is _RUNNING:
                req.spec_token_ids = draft_ids

    def check_prompt_length(self, num_prompt_tokens: int) -> None:
        """Raise ValueError unless a prompt of this many tokens can ever be served (what
        add_request checks), so a caller can refuse a batch before queueing any of it."""
        check_prompt_length(
            num_prompt_tokens, self.max_model_len, self.block_size, self.num_usable_blocks
        )

    def finish_requests(
        self, req_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> list[EngineCoreOutput]:
        """End requests wherever they are (waiting, running, preempted) and free their blocks
        (aborts, and the engine's stop strings); unknown or finished ids are ignored. Returns
        one EngineCoreOutput (no new tokens, the status's finish_reason) per request ended."""
        if not finished_status.is_finished:
            raise ValueError(f"finished_status must be a finished status, got {finished_status}")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        outputs = []
        removed_running = False
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == _RUNNING:
                removed_running = True
            elif req.status == _LOADING:
                self.remote.admitted(req)
            else:
                self.waiting.remove(req)
            req.status = finished_status
            self._release(req)
            outputs.append(finished_output(req))
        if removed_running:
            self.running = [r for r in self.running if r.status == _RUNNING]
        return outputs

    def fail_request(self, req: Request, why: str) -> None:
        """End ``req`` (out of every queue already) with finish_reason "error" and ``why`` as
        its stop_reason; its output comes with the next update_from_output."""
        req.status = RequestStatus.FINISHED_ERROR
        req.stop_reason = why
        self._release(req)
        self._failed_outputs.append(finished_output(req))

    def abort_requests(self, req_ids: str | Iterable[str]) -> list[EngineCoreOutput]:
        """finish_requests with FINISHED_ABORTED (finish_reason "abort")."""
        return self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def abort_all_requests(self) -> list[str]:
        """Abort every unfinished request and free every block, trusting no queue: the recovery
        of a step that raised part-way (an error, or Ctrl-C), after which ``waiting``,
        ``running`` and the block tables may disagree. The prefix cache survives unless the
        pool lost track of a block, in which case the pool is rebuilt empty.

        Returns:
            The ids aborted (the runner is told through ``finished_req_ids`` as usual).
        """
        req_ids = list(self.requests)
        for req in self.requests.values():
            req.status = RequestStatus.FINISHED_ABORTED
        self.requests.clear()
        self.running = []
        self.waiting, _ = make_policy(self.policy)
        self.remote.clear()
        self._failed_outputs.clear()
        self._finished_req_ids.update(req_ids)
        if not self.kv_cache_manager.free_all():
            self.kv_cache_manager = self._new_kv_cache_manager(self.kv_cache_manager)
        return req_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_stats(self) -> dict[str, int | float]:
        """Counters for LLM.get_stats() (docs/architecture.md), plus num_cow_copies."""
        kv = self.kv_cache_manager
        stats = self.stats.report(kv, self.num_kv_blocks, self.host.stats(kv))
        if self.spec_stats is not None:
            stats.update(self.spec_stats.report())
        stats.update(self.remote.stats())
        return stats

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step's tokens and wall time, for "auto" preemption (preemption.py)."""
        self.host.preemption.observe_step(num_tokens, seconds)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; only possible while no request holds a block."""
        return self.kv_cache_manager.reset_prefix_cache()

    def _new_kv_cache_manager(self, counters_from: KVCacheManager | None = None) -> KVCacheManager:
        """An empty pool; the stats counters carry over from ``counters_from`` if given."""
        kv = KVCacheManager(self.block_size, self.num_kv_blocks, self.enable_caching,
                            self.max_model_len, self.host.pool, self.kv_connector)  # fmt: skip
        if counters_from is not None:
            carry_kv_counters(counters_from, kv)
        return kv

    # ----------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running requests first, then waiting ones."""
        budget = self.max_num_batched_tokens
        step = StepBatch(budget if self.token_cap is None else self.token_cap.budget(budget))
        self._schedule_running(step)
        if not step.preempted_req_ids:
            schedule_loaded(self, step)
            schedule_waiting(self, step)
        if self.spec_stats is not None:
            schedule_drafts(self.running, step, self.kv_cache_manager,
                            self.max_num_sampling_rows, self.num_lookahead_tokens,
                            self._max_step_tokens)  # fmt: skip
            self._max_step_tokens = None
        return self._build_output(step)

    def _schedule_running(self, step: StepBatch) -> None:
        """Each running request's next tokens (a decode: 1; a prefill: the rest, up to the
        budget; drafts come last, spec_tokens.schedule_drafts), preempting from the back of
        ``running`` when the pool is full. A table that covers the new tokens needs no
        ``allocate_slots`` (decodes)."""
        running = self.running
        tables = self.kv_cache_manager.req_to_blocks
        bs = self.block_size
        # Preemption pops from the end of ``running`` only (never before ``req``), which a list
        # iterator tolerates: it just stops earlier.
        for req in running:
            budget = step.budget
            if budget <= 0:
                break
            # A step in flight (async scheduling) counts as done: its tokens computed, its
            # sample appended (a placeholder until its results are learned).
            inflight, placeholders = req.num_inflight_tokens, req.num_output_placeholders
            num_tokens = len(req.all_token_ids) + placeholders
            if placeholders and num_tokens >= req.max_num_tokens:
                continue  # the sample in flight ends it ("length"): nothing more to compute
            num_computed = req.num_computed_tokens + inflight
            num_new = min(num_tokens - num_computed, budget)
            if num_new <= 0:
                continue  # nothing left to compute before the step in flight is learned
            table = tables[req.request_id]
            end = num_computed + num_new
            lookahead = lookahead_slots(req, end, end, self.num_lookahead_tokens)
            if end + lookahead <= len(table) * bs:
                new_ids = []
            else:
                new_blocks = self._allocate(req, inflight + num_new, lookahead, step)
                if new_blocks is None:  # req itself was the victim
                    break
                new_ids = [b.block_id for b in new_blocks]
            step.add_cached(req, new_ids, num_new, len(table))

    def _allocate(
        self, req: Request, num_new: int, lookahead: int, step: StepBatch
    ) -> list[KVCacheBlock] | None:
        """Blocks for ``num_new`` tokens past the computed ones (those in flight included) and
        the lookahead slots; when the pool is short, the lookahead is dropped first, then
        lower-ranked requests preempted. Returns the new blocks, or None when ``req`` itself was
        preempted."""
        allocate = self.kv_cache_manager.allocate_slots
        new_blocks = allocate(req, num_new + lookahead)
        if new_blocks is None and lookahead:
            new_blocks = allocate(req, num_new)  # [] when the table covers it
        if new_blocks is None:
            new_blocks = self._preempt_until_fits(req, num_new, step)
        return new_blocks

    def _preempt_until_fits(
        self, req: Request, num_new: int, step: StepBatch
    ) -> list[KVCacheBlock] | None:
        """Preempt the lowest-ranked running requests until ``req`` fits; None if ``req``
        itself had to go. ``running`` is sorted, so the victim is always the last one, which
        this step has not scheduled yet (or is ``req``)."""
        while True:
            victim = self.running.pop()
            self._preempt(victim, step)
            if victim is req:
                return None
            new_blocks = self.kv_cache_manager.allocate_slots(req, num_new)
            if new_blocks is not None:
                return new_blocks

    def _preempt(self, req: Request, step: StepBatch) -> None:
        """Preempt by swap (its blocks move to the host tier, its computed tokens are kept) or
        by recompute (the KV is dropped; full blocks stay in the prefix cache), as the
        preemption policy says; requeue at the front of waiting. The runner drops its state and
        gets it back as a new request. A step in flight for it computes what is then thrown
        away: its results are skipped (the request is not running when they come), and its
        tokens are computed again (a seeded sample draws the same token at the same position)."""
        kv = self.kv_cache_manager
        if not self.host.swap_out(kv, req):
            kv.free(req)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.spec_token_ids = []
        req.num_inflight_tokens = req.num_output_placeholders = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.add_preempted(req)
        step.preempted_req_ids.add(req.request_id)

    def _build_output(self, step: StepBatch) -> SchedulerOutput:
        self.stats.record_step(step, self.block_size)
        finished, self._finished_req_ids = self._finished_req_ids, set()
        kv = self.kv_cache_manager
        out = step.to_output(finished, kv.take_block_copies(), kv.take_host_copies())
        if self.kv_connector is not None:
            out.kv_connector = self.kv_connector.build_meta(out, self.requests, kv)
        return out

    # ----------------------------------------------------------------------------- update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance computed tokens, append samples, check stops, free finished requests.

        Requests finished or aborted since ``schedule()`` are skipped. A sample for a request
        whose tokens are not all computed yet (mid-prefill) is discarded. Returns one
        EngineCoreOutput per request that sampled or received prompt logprobs.
        """
        for req, why in self.remote.learn(model_runner_output.kv_loads, self.kv_cache_manager):
            self.remote.admitted(req)
            self.fail_request(req, why)
        kv = self.kv_cache_manager if self.enable_caching else None
        outputs, finished = process_step(
            self.requests, scheduler_output, model_runner_output, kv, self.spec_stats
        )
        if self._failed_outputs:
            outputs, self._failed_outputs = self._failed_outputs + outputs, []
        if finished:
            self.remote.answer(outputs, finished)
            for req in finished:
                self._release(req)
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    def _release(self, req: Request) -> None:
        """Forget a finished request: free its blocks (tail first), tell the runner."""
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
        self._finished_req_ids.add(req.request_id)
