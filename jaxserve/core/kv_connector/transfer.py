"""TransferConnector: the scheduler's half of ``kv_connector`` "JaxTransferConnector": a
request's prompt KV moves from the producer's device to the consumer's, point to point through
jax.experimental.transfer (what tpu-inference uses between TPU slices), with no store between
them. The runner's half (the transfer server, the gathers, offers, pulls and scatters) is
runner/kv_transfer_worker.py.

Producer (kv_producer, kv_both): a request with kv_transfer_params ``do_remote_decode`` whose
prompt a step completes gets an Offer in that step's KVConnectorMeta: after the forward, the
runner gathers its full prompt blocks into one contiguous array on the device and offers it
under a fresh transfer id until its lease ends (``lease_s``) or a consumer pulls it. The
request's blocks are freed as usual when it finishes: what a consumer pulls is the gathered
copy. The prefill's answer (``producer_params``) names the offer: the producer's transfer
address, the id, the tokens offered, the KV layout's fingerprint, the last offered block's
prefix hash and the lease's end. A prompt whose copy (its blocks padded to a power of two)
alone is larger than the offers may hold at once (``max_held_offers_fraction`` of the KV cache,
``max_offer_blocks``) is not offered: its answer promises nothing, and its decode computes it.

Consumer (kv_consumer, kv_both): a request whose kv_transfer_params name an offer (its prefix
lookup past the local caches, ``lookup``) takes fresh blocks for the offered blocks it lacks
and waits in WAITING_FOR_REMOTE_KVS while the runner pulls the offer and scatters it into
them (a LoadJob whose ``source`` is a PullSource). An offer of another layout (model, block
size, dtype or tensor-parallel size: the fingerprint), of other tokens (the prefix hash), or
whose lease has ended is not pulled; a producer that is gone or a pull that fails loads
nothing. Either way the request got less KV than it was promised, and kv_load_failure_policy
decides ("recompute" or "fail", sched/remote_kv.py), as for the shared-storage connector.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from jaxserve.core.kv_cache_utils import BlockHash, extend_block_hashes
from jaxserve.core.kv_connector.base import KVConnectorMeta, LoadJob, Offer
from jaxserve.kv_transfer_config import KVTransferConfig

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.sched.output import SchedulerOutput
    from jaxserve.request import Request

logger = logging.getLogger("jaxserve")

# kv_transfer_params keys an offer must carry for a consumer to pull it.
OFFER_KEYS = ("remote_host", "remote_port", "remote_transfer_id", "remote_layout",
              "remote_block_hash", "remote_expires_at", "remote_num_tokens")  # fmt: skip


@dataclass(frozen=True)
class PullSource:
    """Where a consumer's LoadJob pulls from: the offer ``transfer_id`` on the producer's
    transfer server ``host``:``port``, of ``num_blocks`` blocks (the prompt's first blocks,
    gathered in order); the job's blocks are offered blocks ``first_block`` on (the ones
    before are device hits already)."""

    host: str
    port: int
    transfer_id: int
    num_blocks: int
    first_block: int
    expires_at: float  # Unix time the offer's lease ends


class TransferConnector:
    """Args:
    config: the role, the lease and the failure policy.
    block_size: tokens per block (P).
    layout: fingerprint of this engine's KV layout (model, block shape, dtype, TP size);
        offers of another layout are not pulled.
    address: (host, port) of this engine's transfer server, named in a producer's answers.
    max_offer_blocks: the most gathered blocks (padded) the runner's offers may hold at once.
    """

    load_async = True  # pulls run in the runner's thread only

    def __init__(
        self,
        config: KVTransferConfig,
        block_size: int,
        layout: str,
        address: tuple[str, int],
        max_offer_blocks: int | None = None,
    ) -> None:
        self.config = config
        self.max_offer_blocks = max_offer_blocks
        self.block_size = block_size
        self.layout = layout
        self.host, self.port = address
        self._jobs: list[LoadJob] = []  # asynchronous loads queued this step
        # req_id -> the offer its last lookup found (this step's lookups; cleared per step).
        self._sources: dict[str, PullSource] = {}
        # req_id -> the producer_params of its offer, until its answer takes them.
        self._offered: dict[str, dict[str, Any]] = {}
        # Counters (monotonic): blocks loaded into this engine, blocks and prompts offered.
        self.num_loaded_blocks = 0
        self.num_offered_blocks = 0
        self.num_offers = 0
        self.num_too_large = 0  # prompts not offered: their copy alone exceeds the cap
        # The runner half's counters (held offers, guarded pulls), merged into stats().
        self._runner_stats: Callable[[], dict[str, int]] | None = None

    # ---- consumer -------------------------------------------------------------------------
    def lookup(
        self, hashes: list[BlockHash], request: Request | None = None, first_block: int = 0
    ) -> list[None]:
        """One None (loaded asynchronously) per block of ``hashes`` (``request``'s blocks from
        ``first_block`` on) that the offer its kv_transfer_params name holds; [] when there is
        none, it cannot be pulled (another layout, other tokens, a lease ended: logged), or
        this engine does not load."""
        if not self.config.loads or request is None:
            return []
        params = request.sampling_params.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or "remote_transfer_id" not in params:
            return []
        why = self._refusal(params, request)
        if why is not None:
            logger.warning("KV transfer: request %r is not pulled: %s", request.request_id, why)
            return []
        num_blocks = params["remote_num_tokens"] // self.block_size
        count = min(len(hashes), num_blocks - first_block)
        if count <= 0:
            return []
        self._sources[request.request_id] = PullSource(
            params["remote_host"], params["remote_port"], params["remote_transfer_id"],
            num_blocks, first_block, float(params["remote_expires_at"]),
        )  # fmt: skip
        return [None] * count

    def _refusal(self, params: dict[str, Any], request: Request) -> str | None:
        """Why the offer ``params`` name cannot be pulled for ``request``, or None."""
        missing = [k for k in OFFER_KEYS if k not in params]
        if missing:
            return f"its kv_transfer_params lack {missing}"
        if params["remote_layout"] != self.layout:
            return (
                f"the producer's KV layout {params['remote_layout']!r} is not this engine's "
                f"{self.layout!r} (model, block size, dtype and tensor-parallel size must match)"
            )
        if params["remote_expires_at"] <= time.time():
            return "the producer's offer expired (its lease_s ended)"
        num_blocks = params["remote_num_tokens"] // self.block_size
        if num_blocks == 0:
            return None
        if request.num_tokens < num_blocks * self.block_size:
            return f"the offer holds {num_blocks} blocks, more than the prompt's"
        last = extend_block_hashes(request, self.block_size, num_blocks)[num_blocks - 1]
        if last.hex() != params["remote_block_hash"]:
            return "the offer holds another prompt's KV (its prefix hash differs)"
        return None

    def queue_load(self, block_id: int, data: Any) -> None:
        raise NotImplementedError("JaxTransferConnector has no synchronous loads")

    def queue_job(self, job: LoadJob) -> None:
        """Start an asynchronous load (a pull of the offer its lookup found) with this step."""
        self._jobs.append(replace(job, source=self._sources.pop(job.req_id, None)))

    def count_loaded(self, num_blocks: int) -> None:
        """An asynchronous load wrote ``num_blocks`` blocks."""
        self.num_loaded_blocks += num_blocks

    # ---- producer -------------------------------------------------------------------------
    def producer_params(self, req: Request) -> dict[str, object]:
        """The kv_transfer_params a finished prefill (``do_remote_decode``) answers with: its
        offer (none when its prompt has no full block, or it ended before a step completed its
        prompt)."""
        params = self._offered.pop(req.request_id, None)
        return params or {"do_remote_prefill": True, "remote_num_tokens": 0}

    def build_meta(
        self, so: SchedulerOutput, requests: Mapping[str, Request], kv: KVCacheManager
    ) -> KVConnectorMeta | None:
        """The step's load jobs and offers; None when there are none."""
        meta = KVConnectorMeta(load_jobs=self._jobs)
        self._jobs, self._sources = [], {}
        for rid in so.finished_req_ids:  # ended without an answer (aborted): forget the offer
            self._offered.pop(rid, None)
        if self.config.saves:
            meta.offers = self._offers(so, requests, kv)
        return meta if meta else None

    def _offers(
        self, so: SchedulerOutput, requests: Mapping[str, Request], kv: KVCacheManager
    ) -> list[Offer]:
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed.update((r.req_id, r.num_computed_tokens) for r in so.scheduled_cached_reqs)
        offers = []
        for rid, num_scheduled in so.num_scheduled_tokens.items():
            req = requests.get(rid)
            if req is None or rid not in computed:
                continue
            if not (req.sampling_params.kv_transfer_params or {}).get("do_remote_decode"):
                continue
            num_drafts = len(so.scheduled_spec_decode_tokens.get(rid, ()))
            end = computed[rid] + num_scheduled - num_drafts
            num_blocks = req.num_prompt_tokens // self.block_size
            if computed[rid] >= req.num_prompt_tokens or end < req.num_prompt_tokens:
                continue  # not the step that completes its prompt
            if num_blocks == 0 or self._too_large(rid, num_blocks):
                continue
            offer = Offer(rid, uuid.uuid4().int >> 65, tuple(kv.get_block_ids(rid)[:num_blocks]),
                          time.time() + self.config.lease_s)  # fmt: skip
            offers.append(offer)
            self._offered[rid] = self._params(offer, req)
            self.num_offers += 1
            self.num_offered_blocks += num_blocks
        return offers

    def _too_large(self, req_id: str, num_blocks: int) -> bool:
        """Whether a copy of ``num_blocks`` blocks (padded) alone exceeds the offers' cap."""
        padded = 1 << (num_blocks - 1).bit_length()  # as kv_transfer_copies pads it
        if self.max_offer_blocks is None or padded <= self.max_offer_blocks:
            return False
        self.num_too_large += 1
        logger.warning("KV transfer: %s's prompt is not offered: its copy of %d blocks is more "
                       "than max_held_offers_fraction allows (%d)", req_id, padded,
                       self.max_offer_blocks)  # fmt: skip
        return True

    def _params(self, offer: Offer, req: Request) -> dict[str, Any]:
        num_blocks = len(offer.block_ids)
        last = extend_block_hashes(req, self.block_size, num_blocks)[num_blocks - 1]
        return {
            "do_remote_prefill": True,
            "remote_num_tokens": num_blocks * self.block_size,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_transfer_id": offer.transfer_id,
            "remote_layout": self.layout,
            "remote_block_hash": last.hex(),
            "remote_expires_at": offer.expires_at,
        }

    def describe(self) -> str:
        """Where the KV goes (the start-up log)."""
        return f"transfer server on {self.host}:{self.port}"

    def report_runner_stats(self, stats: Callable[[], dict[str, int]]) -> None:
        """Merge ``stats()`` (the runner half's counters: kv_transfer_worker.py) into
        ``stats``, so they reach get_stats and /metrics the way this half's do."""
        self._runner_stats = stats

    def stats(self) -> dict[str, int]:
        out = {
            "kv_connector_loaded_blocks": self.num_loaded_blocks,
            # A producer's blocks offered to consumers (the saves of a store's connector).
            "kv_connector_saved_blocks": self.num_offered_blocks,
            "kv_transfer_offers": self.num_offers,
            "kv_transfer_offers_too_large": self.num_too_large,
        }
        if self._runner_stats is not None:
            out.update(self._runner_stats())
        return out
