"""SchedulerStats: the scheduler's counters for ``LLM.get_stats()`` (docs/engine_step.md),
monotonic except the peak, and the one dict the scheduler reports them in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.sched.step_batch import StepBatch


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0  # schedule() calls that scheduled at least one token
    peak_kv_slot_utilization: float = 0.0  # max over steps of live tokens / allocated slots

    def record_step(self, step: StepBatch, block_size: int) -> None:
        """Count a scheduled step that computes at least one token, and its slot use."""
        if not step.num_scheduled_tokens:
            return
        self.num_steps += 1
        utilization = step.slot_utilization(block_size)
        if utilization > self.peak_kv_slot_utilization:
            self.peak_kv_slot_utilization = utilization

    def report(
        self, kv: KVCacheManager, num_kv_blocks: int, host_stats: dict[str, int | float]
    ) -> dict[str, int | float]:
        """The counters, the KV pool's and the host tier's (``host_stats``) as one dict."""
        return {
            "num_kv_blocks": num_kv_blocks,  # as configured: the null block included
            "num_usable_kv_blocks": num_kv_blocks - 1,  # what requests can hold
            "num_free_kv_blocks": kv.block_pool.get_num_free_blocks(),
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
            "num_steps": self.num_steps,
            "peak_kv_slot_utilization": self.peak_kv_slot_utilization,
            "num_cow_copies": kv.num_cow_copies,
            **host_stats,
        }


def carry_kv_counters(old: KVCacheManager, new: KVCacheManager) -> None:
    """Carry the prefix-cache and copy counters of a pool being replaced into its successor
    (get_stats() counts over the engine's life)."""
    new.prefix_cache_queries = old.prefix_cache_queries
    new.prefix_cache_hits = old.prefix_cache_hits
    new.host_cache_hits = old.host_cache_hits
    new.num_cow_copies = old.num_cow_copies
