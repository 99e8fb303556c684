"""Admitting waiting requests: the second pass of ``Scheduler.schedule()``, after the running
requests have had their tokens.

Waiting requests are admitted in policy order while the step's budget, the sequence cap and
the pool last, each from its StartingPoint (prefix hits, a fork child's borrowed blocks) or,
for a swapped-out request, from its blocks swapped back in. Requests whose KV loads from
another engine (the KV connector, loaded asynchronously) come first: they already hold their
blocks (remote_kv.py).
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from jaxserve.core.sched.pending_prefixes import PendingPrefixes
from jaxserve.core.sched.spec_tokens import lookahead_slots
from jaxserve.core.sched.starting_point import StartingPoint, starting_point
from jaxserve.core.sched.step_batch import StepBatch
from jaxserve.request import Request, RequestStatus

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.core.sched.scheduler import Scheduler


def schedule_waiting(sched: Scheduler, step: StepBatch) -> None:
    """Admit waiting requests in policy order while budget, sequences and blocks last.

    Two kinds are passed over for this step (they keep their place in the queue): a child
    whose parent's prompt is not computed yet, and, with prefix caching, a request whose
    next uncached block is one a running request is computing (or one being loaded): next
    step it is a hit, instead of the same block computed twice (offline batches of shared
    prefixes). A request whose prefix lookup found blocks that load asynchronously leaves the
    queue for ``sched.remote`` (WAITING_FOR_REMOTE_KVS), holding its blocks."""
    kv = sched.kv_cache_manager
    waiting = sched.waiting
    skipped: list[Request] = []
    pending = PendingPrefixes(kv, sched.running, sched.block_size)
    while len(waiting) and step.budget > 0 and len(sched.running) < sched.max_num_seqs:
        req = waiting.peek()
        if kv.is_swapped(req.request_id):
            if not _swap_in(sched, req, step):
                break
            continue
        start = starting_point(req, sched.requests, kv, sched.block_size)
        if start is None:
            skipped.append(waiting.pop())
            continue
        if not start.is_fork and sched.enable_caching and pending.defer(req, start.num_tokens):
            start.retract(req, kv, sched.block_size)
            skipped.append(waiting.pop())
            continue
        if not _start(sched, req, start, step):
            break
        # Its blocks past those computed are pending now (a loading request's: all of them).
        pending.admitted(req, req.num_computed_tokens)
    if skipped:
        waiting.put_back(skipped)


def _start(sched: Scheduler, req: Request, start: StartingPoint, step: StepBatch) -> bool:
    """Take ``req`` (waiting's head) out of the queue from ``start``: admitted with its first
    tokens, waiting for its KV to load (remote_kv.py), or failed (its promised KV is missing
    and kv_load_failure_policy is "fail"). False, changing nothing, when the pool is short."""
    kv, waiting = sched.kv_cache_manager, sched.waiting
    borrowed, num_borrowed_tokens, is_fork = start
    remote = sched.remote
    short = None if is_fork else remote.shortfall(req, num_borrowed_tokens)
    if short is not None and remote.fails:
        waiting.pop()
        start.retract(req, kv, sched.block_size)
        sched.fail_request(req, remote.fail_reason(short))
        return True
    loads = not is_fork and remote.loads_async(start)
    # A request that loads takes over its blocks now; its tokens wait for the load.
    num_new = 0 if loads else min(len(req.all_token_ids) - num_borrowed_tokens, step.budget)
    end = num_borrowed_tokens + num_new
    lookahead = lookahead_slots(req, end, end, sched.num_lookahead_tokens) if num_new else 0
    new_blocks = kv.allocate_slots(req, num_new + lookahead, borrowed or None, num_borrowed_tokens)
    if new_blocks is None and lookahead:  # the lookahead is only an optimisation
        new_blocks = kv.allocate_slots(req, num_new, borrowed or None, num_borrowed_tokens)
    if new_blocks is None:
        start.retract(req, kv, sched.block_size)
        return False
    waiting.pop()
    if short is not None:
        remote.fail_reason(short)  # "recompute": counted and logged once admitted
    if is_fork:
        req.parent_req_id = None  # from now on it is an ordinary request
    if loads:
        remote.start(req, kv)
    else:
        admit(sched, req, num_borrowed_tokens, num_new, step)
    return True


def _swap_in(sched: Scheduler, req: Request, step: StepBatch) -> bool:
    """Resume a swapped-out request at its computed tokens (waiting's head); False when
    the device pool cannot take its blocks now."""
    num_new = min(len(req.all_token_ids) - req.num_computed_tokens, step.budget)
    if sched.kv_cache_manager.swap_in(req, num_new) is None:
        return False
    sched.waiting.pop()
    admit(sched, req, req.num_computed_tokens, num_new, step)
    return True


def admit(sched: Scheduler, req: Request, num_computed: int, num_new: int, step: StepBatch) -> None:
    """``req`` (its table covering ``num_computed + num_new`` tokens) joins ``running`` and
    the step schedules ``num_new`` of its tokens."""
    rid = req.request_id
    if req.first_scheduled_time is None:  # first schedule (not a resumed one)
        req.num_cached_tokens = num_computed
        req.first_scheduled_time = time.monotonic()
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = num_computed
    bisect.insort(sched.running, req, key=sched.sort_key)
    step.add_new(req, sched.kv_cache_manager.get_block_ids(rid), num_new)


def schedule_loaded(sched: Scheduler, step: StepBatch) -> None:
    """Requests whose KV finished loading (RemoteKV.ready) join running before any waiting
    request, their loaded tokens computed. One the pool cannot take now goes back to the front
    of waiting, its loaded blocks left in the prefix cache (held, they could starve the pool
    of the blocks running requests need)."""
    kv = sched.kv_cache_manager
    for req, num_computed in sched.remote.take_ready():
        if step.budget <= 0 or len(sched.running) >= sched.max_num_seqs:
            return
        sched.remote.admitted(req)
        req.num_computed_tokens = num_computed
        num_new = min(req.num_tokens - num_computed, step.budget)
        if kv.allocate_slots(req, num_new) is None:
            kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            sched.waiting.add_preempted(req)
            continue
        admit(sched, req, num_computed, num_new, step)
