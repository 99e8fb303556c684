"""KVOffloader: the data side of the host KV tier (core/host_block_pool.py keeps the books).

The host tier is one numpy array allocated once, ``host [Sh, L, 2, K, P, H]`` (Sh host slots;
per slot, every layer's K and V page of one block), in the pages' own dtype: a block's raw
bytes are copied whatever that dtype is (bfloat16, float32, an FP8 cache's float8 values; an
FP8 cache's per-layer scales are not per block and stay on the device). Plain numpy host
memory is used on every platform: pinned host buffers (jax's "pinned_host" memory kind) are
not used yet.

Each step's copies come in the SchedulerOutput and run before anything else touches the
pages, in this order:

    device_to_host   one jitted gather of the blocks [n, L, 2, K, P, H], one transfer to host
    host_to_device   one transfer of the slots' data, one jitted scatter into the pages
                     (the pages donated: updated in place)

The gather runs first because the step reuses the evicted blocks: a restore, a copy-on-write
or the forward may write them next. Counts are padded to a power of two (padding gathers the
null block, and scatters zeros into it) up to ``max_copy_bucket``; larger counts go in chunks
of that size. So the set of compiled shapes is fixed, and warm-up compiles all of them.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.sharding import ShardingPlan
from jaxserve.runner.step_compiles import Compilation, StepCompiles

logger = logging.getLogger("jaxserve")

GIB = 1 << 30
GATHER_ARGS = ("kv_caches", "block_ids")
SCATTER_ARGS = ("kv_caches", "data", "block_ids")


def host_kv_blocks(size_gib: float, block_bytes: int) -> int:
    """Host slots that ``size_gib`` GiB hold: floor(bytes / block_bytes); 0 for 0 GiB.

    Raises:
        ValueError: a size > 0 that holds no block, or more than the machine's physical
            memory (both named with the numbers).
    """
    if size_gib == 0:
        return 0
    size_bytes = int(size_gib * GIB)
    physical = _physical_memory_bytes()
    if physical is not None and size_bytes > physical:
        raise ValueError(
            f"kv_offloading_size={size_gib} GiB ({size_bytes} bytes) is more than this "
            f"machine's {physical} bytes of memory"
        )
    num_blocks = size_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_offloading_size={size_gib} GiB ({size_bytes} bytes) holds no KV block of "
            f"{block_bytes} bytes; give at least {block_bytes / GIB:.3g} GiB or 0 (off)"
        )
    return num_blocks


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system: nothing to check
        return None


class KVOffloader:
    """Host slots and the jitted copies between them and the device pages.

    Args:
        num_layers: L.
        page_shape: (K, S, P, H) of one layer's K (and V) pages.
        dtype: the pages' dtype.
        num_host_blocks: host slots (Sh), >= 1.
        sharding: the pages' sharding plan (tensor parallelism), or None: one device.
        max_copy_bucket: the largest padded copy count; a power of two.
        name: what the compilation counter calls these copies (the logs).
    """

    def __init__(
        self,
        num_layers: int,
        page_shape: tuple[int, int, int, int],
        dtype: Any,
        num_host_blocks: int,
        sharding: ShardingPlan | None = None,
        max_copy_bucket: int = 64,
        name: str = "the host KV tier's block copies",
    ) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be >= 1, got {num_host_blocks}")
        if max_copy_bucket < 1 or max_copy_bucket & (max_copy_bucket - 1):
            raise ValueError(f"max_copy_bucket must be a power of two, got {max_copy_bucket}")
        num_kv_heads, _, block_size, head_dim = page_shape
        self.block_shape = (num_layers, 2, num_kv_heads, block_size, head_dim)  # [L, 2, K, P, H]
        self.dtype = np.dtype(dtype)
        self.block_bytes = math.prod(self.block_shape) * self.dtype.itemsize
        # [Sh, L, 2, K, P, H]; np.zeros maps pages lazily: memory is committed as slots fill.
        self.host = np.zeros((num_host_blocks, *self.block_shape), self.dtype)
        self.copy_sizes = tuple(1 << k for k in range(max_copy_bucket.bit_length()))
        self.compiles = StepCompiles(name)
        if sharding is None:
            gather_sh: dict[str, Any] = {}
            scatter_sh: dict[str, Any] = {}
        else:
            kv, rep = sharding.kv_shardings(num_layers), sharding.replicated
            gather_sh = dict(in_shardings=(kv, rep), out_shardings=rep)
            scatter_sh = dict(in_shardings=(kv, rep, rep), out_shardings=kv)
        self._gather = jax.jit(_gather_blocks, **gather_sh)
        self._scatter = jax.jit(_scatter_blocks, donate_argnums=(0,), **scatter_sh)
        # Counters, monotonic: blocks actually copied each way.
        self.num_device_to_host = 0
        self.num_host_to_device = 0

    @property
    def num_host_blocks(self) -> int:
        return self.host.shape[0]

    # ---- per step -------------------------------------------------------------------------
    def apply(
        self,
        kv_caches: list[tuple[jax.Array, jax.Array]],
        device_to_host: list[tuple[int, int]],
        host_to_device: list[tuple[int, int]],
    ) -> list[tuple[jax.Array, jax.Array]]:
        """Run a step's copies: every (block, slot) device->host first, then every
        (slot, block) host->device. Returns the new pages (the old ones are donated)."""
        for chunk in self._chunks(device_to_host):
            block_ids, slots = self._padded(chunk)
            data = np.asarray(self._run(self._gather, (kv_caches, block_ids), GATHER_ARGS))
            self.host[slots[: len(chunk)]] = data[: len(chunk)]
            self.num_device_to_host += len(chunk)
        for chunk in self._chunks(host_to_device):
            slots, block_ids = self._padded(chunk)
            data = np.zeros((len(block_ids), *self.block_shape), self.dtype)  # [n, L, 2, K, P, H]
            data[: len(chunk)] = self.host[slots[: len(chunk)]]
            kv_caches = self._run(self._scatter, (kv_caches, data, block_ids), SCATTER_ARGS)
            self.num_host_to_device += len(chunk)
        return kv_caches

    def _chunks(self, pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        size = self.copy_sizes[-1]
        return [pairs[i : i + size] for i in range(0, len(pairs), size)]

    def _padded(self, chunk: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """The chunk's two columns as i32 arrays padded with 0 to a power of two."""
        cols = np.zeros((2, 1 << (len(chunk) - 1).bit_length()), np.int32)
        cols[:, : len(chunk)] = np.asarray(chunk, np.int32).T
        return cols[0], cols[1]

    def _run(self, fn: Any, args: tuple[Any, ...], names: tuple[str, ...]) -> Any:
        return self.compiles(fn, args, names)

    # ---- start-up -------------------------------------------------------------------------
    def compilations(self, kv_caches: list[tuple[jax.Array, jax.Array]]) -> list[Compilation]:
        """The gather and the scatter at every padded size, for warm-up (nothing runs)."""
        jobs = []
        for n in self.copy_sizes:
            ids = np.zeros(n, np.int32)
            data = np.zeros((n, *self.block_shape), self.dtype)
            jobs.append(Compilation(self.compiles, self._gather, (kv_caches, ids), GATHER_ARGS))
            jobs.append(
                Compilation(self.compiles, self._scatter, (kv_caches, data, ids), SCATTER_ARGS)
            )
        return jobs

    def measure_bandwidth(
        self, kv_caches: list[tuple[jax.Array, jax.Array]], repeats: int = 3
    ) -> tuple[list[tuple[jax.Array, jax.Array]], float, float]:
        """Device <-> host bandwidth and one transfer's fixed cost, from round trips (a copy
        down, then up) of the null block through the first slots: of one block, and of the
        largest bucket that fits the tier, each the best of ``repeats`` (the first may
        compile). A round trip of n blocks takes 2 * latency + 2 * n * block_bytes / bandwidth.
        Only the null block and free slots are touched.

        Returns:
            (the new pages, bytes per second, seconds of latency per transfer).
        """
        n = min(self.copy_sizes[-1], 1 << (self.num_host_blocks.bit_length() - 1))
        times = {}
        for size in sorted({1, n}):
            pairs = [(0, slot) for slot in range(size)]
            times[size] = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                kv_caches = self.apply(kv_caches, pairs, [(b, s) for s, b in pairs])
                jax.block_until_ready(kv_caches)
                times[size] = min(times[size], time.perf_counter() - start)
            self.num_device_to_host -= repeats * size  # not the engine's traffic
            self.num_host_to_device -= repeats * size
        extra = times[n] - times[1]
        if n > 1 and extra > 0:
            bytes_per_s = 2 * (n - 1) * self.block_bytes / extra
        else:
            bytes_per_s = 2 * n * self.block_bytes / times[n]
        latency_s = max(times[1] / 2 - self.block_bytes / bytes_per_s, 0.0)
        logger.info(
            "host KV tier: %.3g bytes/s device <-> host, %.3g s per transfer",
            bytes_per_s,
            latency_s,
        )
        return kv_caches, bytes_per_s, latency_s


def _gather_blocks(kv_caches, block_ids: jax.Array) -> jax.Array:
    """Blocks ``block_ids`` (i32[n]) of every layer: [n, L, 2, K, P, H]."""
    # Per layer [2, K, n, P, H]; stacked [L, 2, K, n, P, H].
    layers = [jnp.stack([k[:, block_ids], v[:, block_ids]]) for k, v in kv_caches]
    return jnp.moveaxis(jnp.stack(layers), 3, 0)  # [L, 2, K, n, P, H] -> [n, L, 2, K, P, H]


def _scatter_blocks(kv_caches, data: jax.Array, block_ids: jax.Array):
    """Write ``data`` [n, L, 2, K, P, H] into blocks ``block_ids`` (i32[n]) of every layer."""
    data = jnp.moveaxis(data, 0, 3).astype(kv_caches[0][0].dtype)  # [L, 2, K, n, P, H]
    return [
        (k.at[:, block_ids].set(data[i, 0]), v.at[:, block_ids].set(data[i, 1]))
        for i, (k, v) in enumerate(kv_caches)
    ]
