"""StartingPoint: the KV a waiting request starts from when it is admitted.

A request starts from the longest prefix-cache hit of its prompt (device blocks, and host-tier
hits the KV cache manager restores), or, as a parallel-sampling child, from its parent's prompt
blocks once the parent has computed its prompt (the partial last block included: the child
copies it on its first write and recomputes only the last prompt token, to sample its own
first token).
"""

from __future__ import annotations

from typing import NamedTuple

from jaxserve.core.kv_cache_manager import HostHit, KVCacheManager
from jaxserve.core.kv_cache_utils import KVCacheBlock
from jaxserve.core.sched.host_kv_tier import host_tokens
from jaxserve.request import Request, RequestStatus


class StartingPoint(NamedTuple):
    blocks: list[KVCacheBlock | HostHit]  # blocks the request takes over
    num_tokens: int  # tokens those blocks cover (its num_computed_tokens once admitted)
    is_fork: bool  # borrowed from its parent (no prefix-cache lookup to retract)

    def retract(self, req: Request, kv: KVCacheManager, block_size: int) -> None:
        """``req`` is not admitted this step: undo its prefix lookup's counters (a fork made
        none), so a request retried over several steps counts once."""
        if not self.is_fork:
            kv.retract_lookup(req, self.num_tokens, host_tokens(self.blocks, block_size))


def starting_point(
    req: Request, requests: dict[str, Request], kv: KVCacheManager, block_size: int
) -> StartingPoint | None:
    """Where ``req`` starts, or None while it is a child waiting for its parent's prompt KV.
    A child whose parent is gone becomes an ordinary request (``parent_req_id`` cleared)."""
    if req.parent_req_id is not None:
        parent = requests.get(req.parent_req_id)
        if parent is not None:
            if (
                parent.status != RequestStatus.RUNNING
                or parent.num_computed_tokens < req.num_prompt_tokens
            ):
                return None
            num_prompt = req.num_prompt_tokens
            table = kv.get_blocks(parent.request_id)
            return StartingPoint(table[: -(-num_prompt // block_size)], num_prompt - 1, True)
        req.parent_req_id = None  # the parent is gone: compute the prompt alone
    blocks, num_hit_tokens = kv.get_computed_blocks(req)
    return StartingPoint(blocks, num_hit_tokens, False)
