"""HostKVTier: the scheduler's side of the host KV tier, in one object, so that the scheduler
does not branch on whether there is one.

It holds the host block pool (None without a tier: the KV cache manager then never offloads or
looks up host blocks), the preemption policy that chooses between swapping a preempted
request's KV to the host and recomputing it (preemption.py), and the tier's counters. Without
a tier (``num_blocks`` 0) every preemption recomputes and every counter stays 0.
"""

from __future__ import annotations

from jaxserve.config import CacheConfig
from jaxserve.core.host_block_pool import HostBlockPool, HostTier
from jaxserve.core.kv_cache_manager import HostHit, KVCacheManager
from jaxserve.core.kv_cache_utils import KVCacheBlock
from jaxserve.core.sched.preemption import PreemptionPolicy
from jaxserve.request import Request


class HostKVTier:
    """The host pool, the swap-or-recompute choice and the counters of get_stats().

    Args:
        cache_config: kv_offloading_size (> 0 needs a tier of > 0 blocks) and preemption_mode.
        host_tier: the runner's host KV tier (its size and measured copy rates), or None.

    Raises:
        ValueError: kv_offloading_size and the tier's size disagree (one is 0, the other not).
    """

    def __init__(self, cache_config: CacheConfig, host_tier: HostTier | None) -> None:
        num_blocks = host_tier.num_blocks if host_tier is not None else 0
        if (cache_config.kv_offloading_size > 0) != (num_blocks > 0):
            raise ValueError(
                f"kv_offloading_size={cache_config.kv_offloading_size} GiB needs a host tier "
                f"of > 0 blocks and 0 GiB none; got a host tier of {num_blocks} blocks"
            )
        tier = host_tier if host_tier is not None else HostTier(0, block_bytes=1)
        self.pool = HostBlockPool(num_blocks) if num_blocks else None
        self.block_bytes = tier.block_bytes if num_blocks else 0
        self.preemption = PreemptionPolicy(
            cache_config.preemption_mode,
            tier.swap_bytes_per_s,
            tier.block_bytes,
            tier.swap_latency_s,
        )
        self.num_swap_preemptions = 0  # preemptions that kept the KV in the host tier
        self.num_swap_fallbacks = 0  # swaps wanted but recomputed: the host tier was full

    def swap_out(self, kv: KVCacheManager, req: Request) -> bool:
        """Move a request being preempted to the host tier when the policy prefers a swap and
        the tier takes its blocks; False: the caller drops its KV for recompute."""
        if self.pool is None or not self.preemption.wants_swap(
            kv.swap_blocks(req), kv.recompute_tokens(req)
        ):
            return False
        if kv.swap_out(req):
            self.num_swap_preemptions += 1
            return True
        self.num_swap_fallbacks += 1
        return False

    def stats(self, kv: KVCacheManager) -> dict[str, int]:
        """The tier's counters (all 0 without one); bytes are block copies * block bytes."""
        pool = self.pool
        return {
            "num_host_kv_blocks": pool.num_blocks if pool is not None else 0,
            "host_cache_hits": kv.host_cache_hits,
            "device_to_host_bytes": pool.num_offloaded * self.block_bytes if pool else 0,
            "host_to_device_bytes": pool.num_restored * self.block_bytes if pool else 0,
            "num_swap_preemptions": self.num_swap_preemptions,
            "num_swap_fallbacks": self.num_swap_fallbacks,
        }


def host_tokens(blocks: list[KVCacheBlock | HostHit], block_size: int) -> int:
    """Tokens of a prefix-cache lookup found in the host tier (its HostHit entries)."""
    return block_size * sum(1 for b in blocks if isinstance(b, HostHit))
