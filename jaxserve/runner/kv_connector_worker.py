"""KVConnectorWorker: the runner's half of the KV connector (the scheduler's half is
core/kv_connector/): it writes the blocks a consumer loads into the device pages before the
forward, and reads the blocks a producer saves out of them after it.

Asynchronous loads (KVConnectorMeta.load_jobs): each job's blocks are read from the store in a
thread of the worker's own, so no step waits for the store; the first step dispatched after
the data is there writes it into the job's device blocks (before its forward, on the step's
thread: the pages are donated from step to step), and reports the job's blocks written in that
step's ModelRunnerOutput.kv_loads. A job whose request finished (aborted) before that is
dropped, never written: its blocks may belong to another request by then. A step with nothing
to compute, and no row in the runner, waits for a read a little (``idle_wait_s``) instead of
spinning.

Both go through a small staging host tier (kv_offload.KVOffloader: its jitted gather and
scatter at padded power-of-two counts), ``staging_blocks`` blocks at a time, so the copies reuse
the host tier's compiled shapes and its float / FP8 handling: a block's raw bytes in the pages'
own dtype. An FP8 cache's per-layer scales come from the checkpoint, the same in every engine
of one model, so they are not transferred.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
from typing import Any

import jax
import numpy as np

from jaxserve.core.kv_connector.base import KVConnectorMeta, LoadJob
from jaxserve.core.kv_connector.ray_store import RayBlockStore
from jaxserve.core.kv_connector.shared_storage import SharedStorageConnector
from jaxserve.core.kv_connector.store import BlockStore
from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.kv_transfer_config import KVTransferConfig
from jaxserve.runner.kv_offload import KVOffloader
from jaxserve.runner.sharding import ShardingPlan

KVCaches = list[tuple[jax.Array, jax.Array]]

logger = logging.getLogger("jaxserve")


class KVConnectorWorker:
    """Args:
    connector: the scheduler's half (the store the saves go to).
    staging: the staging host tier the copies go through.
    """

    idle_wait_s = 0.05  # an empty step's wait for a load being read
    num_reader_threads = 1  # loads read at once (a store's reads are short)

    def __init__(self, connector: SharedStorageConnector, staging: KVOffloader) -> None:
        self.connector = connector
        self.staging = staging
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None  # made on first use
        self._jobs: dict[str, tuple[LoadJob, concurrent.futures.Future]] = {}  # being read
        self._done: dict[str, int] = {}  # req_id -> blocks written this step

    def before_forward(
        self, kv_caches: KVCaches, so: SchedulerOutput, idle: bool = False
    ) -> tuple[KVCaches, dict[str, int]]:
        """The step's loads: jobs of finished requests dropped, new jobs started, the jobs
        whose data is here written (``idle``: the runner has nothing to compute, so it first
        waits up to ``idle_wait_s`` for one), then the synchronous loads. Returns the new
        pages and the jobs written (req_id -> blocks), for the step's
        ModelRunnerOutput.kv_loads."""
        for req_id in so.finished_req_ids:
            job = self._jobs.pop(req_id, None)
            if job is not None:
                job[1].cancel()
        meta = so.kv_connector
        if meta is not None and meta.load_jobs:
            if self._reader is None:
                self._reader = concurrent.futures.ThreadPoolExecutor(
                    self.num_reader_threads, thread_name_prefix="jaxserve-kv-load"
                )
            for job in meta.load_jobs:
                self._jobs[job.req_id] = (job, self._reader.submit(self._read, job))
        if self._jobs:
            kv_caches = self._write_ready(kv_caches, wait=idle)
        if meta is not None and meta.loads:
            kv_caches = self.load(kv_caches, meta.loads)
        done, self._done = self._done, {}
        return kv_caches, done

    @property
    def num_pending_loads(self) -> int:
        """Asynchronous loads started and not yet written or dropped."""
        return len(self._jobs)

    def reset(self) -> None:
        """Drop every load (the engine aborted every request)."""
        for _, future in self._jobs.values():
            future.cancel()
        self._jobs.clear()

    def close(self) -> None:
        """Drop every load and stop the reader threads (the engine shuts down: a read under
        way is waited for); idempotent."""
        self.reset()
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
            self._reader = None

    def _read(self, job: LoadJob) -> Any:
        """The job's leading blocks the store gives (in the reader thread)."""
        try:
            return self.connector.store.read_prefix(job.hashes)
        except Exception as e:  # a store gone (a Ray actor killed): nothing loads
            logger.warning("KV connector: load of %s failed (%s)", job.req_id, e)
            return []

    def _write_ready(self, kv_caches: KVCaches, wait: bool) -> KVCaches:
        if wait:
            futures = [future for _, future in self._jobs.values()]
            concurrent.futures.wait(futures, self.idle_wait_s, concurrent.futures.FIRST_COMPLETED)
        for req_id, (job, future) in list(self._jobs.items()):
            if future.done():
                del self._jobs[req_id]
                kv_caches, self._done[req_id] = self._write(kv_caches, job, future.result())
        return kv_caches

    def _write(self, kv_caches: KVCaches, job: LoadJob, data: Any) -> tuple[KVCaches, int]:
        """Write what ``_read`` gave for ``job`` into its blocks; returns the new pages and
        the number of blocks written (its first ones)."""
        loads = list(zip(job.block_ids, data, strict=False))
        return self.load(kv_caches, loads), len(loads)

    def load(self, kv_caches: KVCaches, loads: list[tuple[int, np.ndarray]]) -> KVCaches:
        """Write (device block id, data) pairs into the pages; returns the new pages."""
        n = self.staging.num_host_blocks
        for start in range(0, len(loads), n):
            chunk = loads[start : start + n]
            for slot, (_, data) in enumerate(chunk):
                self.staging.host[slot] = data
            pairs = [(slot, block_id) for slot, (block_id, _) in enumerate(chunk)]
            kv_caches = self.staging.apply(kv_caches, [], pairs)
        return kv_caches

    def save(self, kv_caches: KVCaches, meta: KVConnectorMeta) -> KVCaches:
        """Store the step's saved blocks (after the forward wrote them); returns the pages."""
        n = self.staging.num_host_blocks
        for start in range(0, len(meta.saves), n):
            chunk = meta.saves[start : start + n]
            pairs = [(block_id, slot) for slot, (block_id, _) in enumerate(chunk)]
            kv_caches = self.staging.apply(kv_caches, pairs, [])
            for slot, (_, block_hash) in enumerate(chunk):
                self.connector.save_block(block_hash, self.staging.host[slot])
        return kv_caches


def make_kv_connector(
    config: KVTransferConfig,
    model_name: str,
    num_layers: int,
    page_shape: tuple[int, int, int, int],
    dtype: Any,
    sharding: ShardingPlan | None,
    staging_blocks: int = 16,
) -> KVConnectorWorker:
    """The connector of ``config`` for pages ``page_shape`` (K, S, P, H) x ``num_layers`` of
    ``dtype``: its store's subfolder is named by the model and this layout, so engines of other
    models or layouts never share blocks with it."""
    staging = KVOffloader(num_layers, page_shape, dtype, staging_blocks, sharding,
                          max_copy_bucket=staging_blocks,
                          name="the KV connector's block copies")  # fmt: skip
    layout = f"{model_name}|{staging.block_shape}|{np.dtype(dtype).name}"
    fingerprint = hashlib.sha256(layout.encode()).hexdigest()[:16]
    if config.transport == "ray":
        store = RayBlockStore(fingerprint, staging.block_shape, staging.dtype, config.lease_s,
                              config.ray_address, config.ray_namespace)  # fmt: skip
    else:
        store = BlockStore(config.path, fingerprint, staging.block_shape, staging.dtype,
                           config.lease_s)  # fmt: skip
    block_size = page_shape[2]
    return KVConnectorWorker(SharedStorageConnector(config, store, block_size), staging)
