"""TransferCopies: the device copies of ``kv_connector`` "JaxTransferConnector"
(kv_transfer_worker.py): a producer's jitted gather of a prompt's blocks out of the pages into
one contiguous array, and a consumer's jitted scatter of a pulled array into its pages.

    gather    pages, block_ids i32[n]            -> data [n, L, 2, K, P, H]  (the pages' dtype)
    scatter   pages, data [n, L, 2, K, P, H],
              block_ids i32[n]                   -> pages (donated: updated in place)

A block's raw values travel in the pages' own dtype (float or an FP8 cache's float8 values; an
FP8 cache's per-layer scales come from the checkpoint and are the same in both engines). Counts
are padded to a power of two up to the pool's size (padding gathers the null block 0; a
scatter row aimed at block 0 writes zeros there), so the set of compiled shapes is fixed and
warm-up compiles all of them; both engines pad alike, so a consumer knows the shape it pulls
from the offer's block count. The gathered array is replicated over the mesh, as the host
tier's copies are (kv_offload.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.kv_offload import GATHER_ARGS, SCATTER_ARGS, _gather_blocks, _scatter_blocks
from jaxserve.runner.sharding import ShardingPlan
from jaxserve.runner.step_compiles import Compilation, StepCompiles

KVCaches = list[tuple[jax.Array, jax.Array]]


def padded_blocks(num_blocks: int) -> int:
    """The power of two a count of ``num_blocks`` (>= 1) blocks is padded to."""
    return 1 << (num_blocks - 1).bit_length()


class TransferCopies:
    """Args:
    num_layers: L.
    page_shape: (K, S, P, H) of one layer's K (or V) pages.
    dtype: the pages' dtype.
    sharding: the engine's sharding plan, or None (one device).
    """

    def __init__(
        self,
        num_layers: int,
        page_shape: tuple[int, int, int, int],
        dtype: Any,
        sharding: ShardingPlan | None,
    ) -> None:
        num_kv_heads, num_blocks, block_size, head_dim = page_shape
        self.block_shape = (num_layers, 2, num_kv_heads, block_size, head_dim)  # [L, 2, K, P, H]
        self.dtype = np.dtype(dtype)
        self.copy_sizes = tuple(1 << k for k in range(padded_blocks(num_blocks).bit_length()))
        self.compiles = StepCompiles("the KV transfer's gathers and scatters")
        if sharding is None:
            self.out_sharding: Any = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            gather_sh: dict[str, Any] = {}
            scatter_sh: dict[str, Any] = {}
        else:
            kv, self.out_sharding = sharding.kv_shardings(num_layers), sharding.replicated
            gather_sh = dict(in_shardings=(kv, self.out_sharding), out_shardings=self.out_sharding)
            scatter_sh = dict(in_shardings=(kv, self.out_sharding, self.out_sharding),
                              out_shardings=kv)  # fmt: skip
        self._gather = jax.jit(_gather_blocks, **gather_sh)
        self._scatter = jax.jit(_scatter_rows, donate_argnums=(0,), **scatter_sh)

    def spec(self, num_blocks: int) -> jax.ShapeDtypeStruct:
        """What a gather of ``num_blocks`` blocks makes: the shape a consumer pulls."""
        shape = (padded_blocks(num_blocks), *self.block_shape)
        return jax.ShapeDtypeStruct(shape, self.dtype, sharding=self.out_sharding)

    def gather(self, kv_caches: KVCaches, block_ids: tuple[int, ...]) -> jax.Array:
        """Blocks ``block_ids`` (in order, then the null block to the padded count) as one
        array [n, L, 2, K, P, H] on the device (dispatched, not waited for)."""
        ids = np.zeros(padded_blocks(len(block_ids)), np.int32)
        ids[: len(block_ids)] = block_ids
        return self.compiles(self._gather, (kv_caches, ids), GATHER_ARGS)

    def scatter(self, kv_caches: KVCaches, data: jax.Array, block_ids: np.ndarray) -> KVCaches:
        """Write row i of ``data`` [n, L, 2, K, P, H] into block ``block_ids[i]`` (i32[n]; 0:
        skip the row). Returns the new pages (the old ones are donated)."""
        return self.compiles(self._scatter, (kv_caches, data, block_ids), SCATTER_ARGS)

    def compilations(self, kv_caches: KVCaches) -> list[Compilation]:
        """The gather and the scatter at every padded count, for warm-up (nothing runs)."""
        jobs = []
        for n in self.copy_sizes:
            ids = np.zeros(n, np.int32)
            data = self.spec(n)  # as pulled: on the device, in the gather's sharding
            jobs.append(Compilation(self.compiles, self._gather, (kv_caches, ids), GATHER_ARGS))
            jobs.append(
                Compilation(self.compiles, self._scatter, (kv_caches, data, ids), SCATTER_ARGS)
            )
        return jobs


def _scatter_rows(kv_caches, data: jax.Array, block_ids: jax.Array):
    """``_scatter_blocks`` with the rows aimed at the null block 0 zeroed (rows of blocks the
    consumer had already, and the padding)."""
    keep = (block_ids > 0).reshape(-1, *([1] * (data.ndim - 1)))  # [n, 1, 1, 1, 1, 1]
    return _scatter_blocks(kv_caches, jnp.where(keep, data, jnp.zeros_like(data)), block_ids)
