"""KVConnectorMeta: what the scheduler's half of the KV connector hands the runner each step
(SchedulerOutput.kv_connector), as vLLM V1's connector metadata.

Synchronous loads (``loads``) run before the forward (after the host tier's copies, before
copy-on-write): the blocks a consumer's prefix lookup found in the store, already read into
host memory by the scheduler, so a block that cannot be read is known before the request is
admitted and is computed instead (kv_load_failure_policy "recompute"). Asynchronous loads
(``load_jobs``) are started by the runner and finished in a later step (runner/
kv_connector_worker.py); the request waits in WAITING_FOR_REMOTE_KVS meanwhile, and the
runner reports each job's outcome in ModelRunnerOutput.kv_loads. Saves run after the forward:
the prompt blocks this step completes, so a producer's blocks are in the store before its
answer (max_tokens 1) leaves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from jaxserve.core.kv_cache_utils import BlockHash

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.sched.output import SchedulerOutput
    from jaxserve.kv_transfer_config import KVTransferConfig
    from jaxserve.request import Request


@dataclass(frozen=True)
class LoadJob:
    """One request's asynchronous load: read ``hashes`` from the store, in order, into the
    device blocks ``block_ids`` (fresh blocks the request holds); stop at the first block the
    store cannot give (the runner reports how many it wrote)."""

    req_id: str
    block_ids: tuple[int, ...]
    hashes: tuple[BlockHash, ...]
    # Where the blocks come from, for a connector that pulls them from a named producer
    # (core/kv_connector/transfer.py's PullSource); None for a store looked up by hash.
    source: Any = None


@dataclass(frozen=True)
class Offer:
    """A producer's prefill whose prompt this step completes: after the forward, its full
    prompt blocks ``block_ids`` (in table order) are gathered on the device and offered under
    ``transfer_id`` until ``expires_at`` (Unix time) or the consumer's pull."""

    req_id: str
    transfer_id: int
    block_ids: tuple[int, ...]
    expires_at: float


@dataclass
class KVConnectorMeta:
    """loads: (device block id, data [L, 2, K, P, H] in the pages' dtype) to write before the
    forward. load_jobs: asynchronous loads to start. saves: (device block id, its prefix hash)
    to read after the forward and store. offers: prompts to gather and offer after the
    forward."""

    loads: list[tuple[int, np.ndarray]] = field(default_factory=list)
    load_jobs: list[LoadJob] = field(default_factory=list)
    saves: list[tuple[int, BlockHash]] = field(default_factory=list)
    offers: list[Offer] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.load_jobs or self.saves or self.offers)

    @property
    def after_forward(self) -> bool:
        """Whether the runner has work after the step's forward (saves or offers)."""
        return bool(self.saves or self.offers)


class KVConnector(Protocol):
    """The scheduler's half of a KV connector, as the KV cache manager and the scheduler use
    it (shared_storage.py: SharedStorageConnector over a store, transfer.py:
    TransferConnector device to device)."""

    config: KVTransferConfig
    block_size: int
    load_async: bool  # lookups only count blocks; the runner loads them (LoadJob)

    def lookup(
        self, hashes: list[BlockHash], request: Request | None = None, first_block: int = 0
    ) -> list[Any]:
        """One entry per leading block of ``hashes`` it can give (its data, or None when it
        loads asynchronously)."""

    def queue_load(self, block_id: int, data: np.ndarray) -> None: ...

    def queue_job(self, job: LoadJob) -> None: ...

    def count_loaded(self, num_blocks: int) -> None: ...

    def producer_params(self, req: Request) -> dict[str, object]:
        """A finished prefill's (do_remote_decode) kv_transfer_params for its decode."""

    def build_meta(
        self, so: SchedulerOutput, requests: Mapping[str, Request], kv: KVCacheManager
    ) -> KVConnectorMeta | None: ...

    def describe(self) -> str: ...

    def stats(self) -> dict[str, int]: ...
