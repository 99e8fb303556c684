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

from dataclasses import dataclass, field

import numpy as np

from jaxserve.core.kv_cache_utils import BlockHash


@dataclass(frozen=True)
class LoadJob:
    """One request's asynchronous load: read ``hashes`` from the store, in order, into the
    device blocks ``block_ids`` (fresh blocks the request holds); stop at the first block the
    store cannot give (the runner reports how many it wrote)."""

    req_id: str
    block_ids: tuple[int, ...]
    hashes: tuple[BlockHash, ...]


@dataclass
class KVConnectorMeta:
    """loads: (device block id, data [L, 2, K, P, H] in the pages' dtype) to write before the
    forward. load_jobs: asynchronous loads to start. saves: (device block id, its prefix hash)
    to read after the forward and store."""

    loads: list[tuple[int, np.ndarray]] = field(default_factory=list)
    load_jobs: list[LoadJob] = field(default_factory=list)
    saves: list[tuple[int, BlockHash]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.load_jobs or self.saves)
