"""RemoteKV: the scheduler's side of the KV connector in one object, so that the scheduler does
not branch on whether there is one.

It checks a request's promised KV (``kv_transfer_params``: ``remote_num_tokens`` of its
prompt, from the prefill server's answer) against what its prefix lookup found, and applies
``kv_load_failure_policy``: "recompute" computes what is missing, "fail" ends the request
with finish_reason "error". It holds the requests whose KV loads asynchronously
(WAITING_FOR_REMOTE_KVS: admitted, holding their blocks, neither waiting nor running) until
the runner reports each load's outcome (ModelRunnerOutput.kv_loads); the first step after
that schedules them, with the loaded tokens computed. A load that stopped early is a failure
like a missing block: the blocks it did not write are freed and the policy applies. Without a
connector no request ever loads and nothing is promised that could be checked.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_connector.base import LoadJob
from jaxserve.core.kv_connector.remote_hits import RemoteHit
from jaxserve.core.sched.starting_point import StartingPoint
from jaxserve.kv_transfer_config import expected_remote_tokens
from jaxserve.outputs import EngineCoreOutput
from jaxserve.request import Request, RequestStatus

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.core.kv_connector.base import KVConnector

logger = logging.getLogger("jaxserve")


class RemoteKV:
    """Args:
    connector: the KV connector's scheduler half, or None.
    block_size: tokens per block (P).
    """

    def __init__(self, connector: KVConnector | None, block_size: int) -> None:
        self.connector = connector
        self.block_size = block_size
        config = connector.config if connector is not None else None
        self.fails = config is not None and config.kv_load_failure_policy == "fail"
        # WAITING_FOR_REMOTE_KVS requests by id, in the order their loads started; each holds
        # its blocks (device hits, then the blocks being loaded).
        self.loading: dict[str, Request] = {}
        # Of those, the ones whose load the runner finished, with the tokens now computed,
        # in the order learned: scheduled first, before any waiting request.
        self.ready: dict[str, int] = {}
        # Lookups or loads that gave a request less KV than it was promised; monotonic.
        self.num_load_failures = 0

    def shortfall(self, req: Request, num_found: int) -> str | None:
        """None, or why ``req``, whose KV lookup (or load) gave it ``num_found`` prompt tokens,
        got less than its kv_transfer_params promise. Changes nothing."""
        promised = expected_remote_tokens(req.sampling_params.kv_transfer_params)
        if req.sampling_params.prompt_logprobs is not None or req.num_preemptions:
            # It computes its whole prompt anyway (its logprobs need every position), or it
            # had the promised KV once and lost it to a preemption here: not the producer's.
            promised = 0
        promised = min(promised, (req.num_tokens - 1) // self.block_size * self.block_size)
        if num_found >= promised:
            return None
        return (
            f"request {req.request_id!r}: its kv_transfer_params promise {promised} prompt "
            f"tokens of KV from the prefill server, only {num_found} could be loaded (missing, "
            "expired or unreadable)"
        )

    def fail_reason(self, why: str) -> str | None:
        """``why`` (a shortfall) as the reason to fail the request under policy "fail";
        None under "recompute" (logged: the request computes what is missing)."""
        self.num_load_failures += 1
        if self.fails:
            return why + "; kv_load_failure_policy 'fail' ends it"
        logger.info("%s: computed instead (kv_load_failure_policy 'recompute')", why)
        return None

    def loads_async(self, start: StartingPoint) -> bool:
        """Whether the blocks ``start`` takes over include some that load asynchronously."""
        return any(isinstance(b, RemoteHit) and b.data is None for b in start.blocks)

    def start(self, req: Request, kv: KVCacheManager) -> None:
        """``req`` holds its blocks (allocate_slots with no new token): its load starts."""
        rid = req.request_id
        block_ids, hashes = kv.remote.job(rid)
        self.connector.queue_job(LoadJob(rid, block_ids, hashes))
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[rid] = req

    def learn(self, kv_loads: dict[str, int], kv: KVCacheManager) -> list[tuple[Request, str]]:
        """The runner finished these loads (req_id -> blocks written). Their blocks enter the
        prefix cache (those not written are freed) and the requests are ready. Returns the
        requests to fail (policy "fail"), each with why."""
        failed = []
        for rid, num_loaded in kv_loads.items():
            req = self.loading.get(rid)
            if req is None or rid in self.ready:
                continue  # aborted since, its load dropped
            self.connector.count_loaded(num_loaded)
            num_computed = kv.finish_remote_load(req, num_loaded)
            why = self.shortfall(req, num_computed)
            why = self.fail_reason(why) if why is not None else None
            if why is not None:
                failed.append((req, why))
            else:
                self.ready[rid] = num_computed
        return failed

    def answer(self, outputs: list[EngineCoreOutput], finished: list[Request]) -> None:
        """Give each finished prefill (kv_transfer_params do_remote_decode) of a producer the
        kv_transfer_params its decode request passes on."""
        if self.connector is None or not self.connector.config.saves:
            return
        params = {
            r.request_id: self.connector.producer_params(r)
            for r in finished
            if (r.sampling_params.kv_transfer_params or {}).get("do_remote_decode")
        }
        for out in outputs if params else ():
            if out.req_id in params:
                out.kv_transfer_params = params[out.req_id]

    def take_ready(self) -> list[tuple[Request, int]]:
        """The ready requests with their computed tokens, in the order learned."""
        return [(self.loading[rid], num) for rid, num in self.ready.items()]

    def admitted(self, req: Request) -> None:
        """``req`` left WAITING_FOR_REMOTE_KVS (scheduled, requeued or ended)."""
        self.loading.pop(req.request_id, None)
        self.ready.pop(req.request_id, None)

    def clear(self) -> None:
        self.loading.clear()
        self.ready.clear()

    def stats(self) -> dict[str, int]:
        if self.connector is None:
            return {}
        stats = self.connector.stats()
        stats["kv_connector_load_failures"] = self.num_load_failures
        stats["num_requests_waiting_for_remote_kvs"] = len(self.loading)
        return stats
