"""OfferReserve: the device memory a KV producer's held offers may take, in the memory plan.

A producer of ``kv_connector`` "JaxTransferConnector" (kv_role kv_producer or kv_both) keeps
each completed prompt's blocks as a gathered copy on its devices until a consumer pulls it
(kv_transfer_offers.py), besides its pool of pages. Its offers hold at most
``max_held_offers_fraction`` of the pool's device memory (kv_transfer_config.max_held_blocks:
a gathered block is replicated over the mesh, so with pages sharded over tp devices it costs
tp pool blocks a device), and the memory plan (memory_plan.py) reserves that cap: a producer's
pool is the largest N whose N blocks and whose cap of copies fit in the KV budget together,
about 1 / (1 + fraction) of a consumer's. (A consumer's pulled arrays live only from the pull
to the next step's scatter, a few at once: inside the workspace's margin, not reserved.)
"""

from __future__ import annotations

import dataclasses

from jaxserve.config import EngineConfig
from jaxserve.kv_transfer_config import max_held_blocks
from jaxserve.models import TP_AXIS, CausalLM
from jaxserve.runner.memory_sizes import kv_bytes_per_token


@dataclasses.dataclass(frozen=True)
class OfferReserve:
    """A producer's cap of held offers, per device.

    fraction: max_held_offers_fraction.
    copy_ratio: pool blocks (per device) one gathered block costs: tp when the pages are
        sharded, else 1.
    bytes_per_copy_block: one gathered block's bytes per device (every KV head: replicated).
    """

    fraction: float
    copy_ratio: int
    bytes_per_copy_block: int

    def blocks(self, num_kv_blocks: int) -> int:
        """The most gathered blocks the offers of a pool of ``num_kv_blocks`` may hold."""
        return max_held_blocks(self.fraction, num_kv_blocks, self.copy_ratio)

    def bytes(self, num_kv_blocks: int) -> int:
        """Their bytes per device."""
        return self.blocks(num_kv_blocks) * self.bytes_per_copy_block

    def pool_blocks(self, free_bytes: int, bytes_per_block: int) -> int:
        """The most pool blocks N (0: none) with N x ``bytes_per_block`` + bytes(N) <=
        ``free_bytes``."""
        if free_bytes <= 0:
            return 0
        share = self.fraction * self.bytes_per_copy_block / self.copy_ratio
        n = int(free_bytes // (bytes_per_block + share))
        while n > 0 and n * bytes_per_block + self.bytes(n) > free_bytes:  # the floor's 1
            n -= 1
        return n


def offer_reserve(
    model: CausalLM,
    held_offers_fraction: float | None,
    *,
    tensor_parallel_size: int,
    kv_cache_dtype: str,
    block_size: int,
) -> OfferReserve | None:
    """The reserve of a producer whose offers may hold ``held_offers_fraction`` of its pool
    (None: not a JaxTransferConnector producer: no reserve).

    Raises:
        ValueError: a fraction outside (0, 1].
    """
    f = held_offers_fraction
    if f is None:
        return None
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
        raise ValueError(f"held_offers_fraction must be a number in (0, 1], got {f!r}")
    sharded = model.kv_cache_partition_spec(tensor_parallel_size)[0] == TP_AXIS
    return OfferReserve(
        fraction=float(f),
        copy_ratio=tensor_parallel_size if sharded else 1,
        bytes_per_copy_block=kv_bytes_per_token(model, 1, kv_cache_dtype) * block_size,
    )


def held_offers_fraction_of(config: EngineConfig) -> float | None:
    """The engine config's max_held_offers_fraction when it is a JaxTransferConnector producer
    (kv_role kv_producer or kv_both), else None."""
    kv = config.kv_transfer
    if kv is None or kv.transport != "jax_transfer" or not kv.saves:
        return None
    return kv.max_held_offers_fraction
