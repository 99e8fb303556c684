"""RayBlockStore: the BlockStore interface (store.py) over a named Ray actor, so engines on the
hosts of one Ray cluster share KV blocks (``kv_connector`` "RayStoreConnector").

The actor (one per model and KV layout, named by the layout's fingerprint, detached, in the
config's namespace, no CPU reserved) holds each block's bytes under its prefix hash with the
time it was written; a block older than ``lease_s`` is neither returned nor kept. Blocks travel
as bytes through Ray's own transport (a put is waited for, so a producer's blocks are stored
before its answer leaves); a consumer's lookup is one call for a run of hashes. The actor holds
the blocks in its own memory: a producer that dies leaves them readable until their lease ends.
``ray`` is imported only here, when such a store is made.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxserve.core.kv_cache_utils import BlockHash
from jaxserve.core.kv_connector.store import layout_header


class _BlockActor:
    """The blocks: hash -> (write time, layout header, bytes)."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.blocks: dict[bytes, tuple[float, bytes, bytes]] = {}
        self._next_sweep = 0.0

    def put(self, key: bytes, header: bytes, payload: bytes) -> None:
        now = time.time()
        self.blocks[key] = (now, header, payload)
        if now >= self._next_sweep:
            self._next_sweep = now + self.lease_s / 4
            old = [k for k, (t, _, _) in self.blocks.items() if now - t >= self.lease_s]
            for k in old:
                del self.blocks[k]

    def get_prefix(self, keys: list[bytes], header: bytes) -> list[bytes]:
        now, out = time.time(), []
        for key in keys:
            entry = self.blocks.get(key)
            if entry is None or now - entry[0] >= self.lease_s or entry[1] != header:
                break
            out.append(entry[2])
        return out

    def count_prefix(self, keys: list[bytes], header: bytes) -> int:
        now, num = time.time(), 0
        for key in keys:
            entry = self.blocks.get(key)
            if entry is None or now - entry[0] >= self.lease_s or entry[1] != header:
                break
            num += 1
        return num

    def contains(self, key: bytes) -> bool:
        entry = self.blocks.get(key)
        return entry is not None and time.time() - entry[0] < self.lease_s

    def size(self) -> int:
        return len(self.blocks)


class RayBlockStore:
    """Args: as BlockStore's, plus address (of the Ray cluster: "auto" joins the one this host
    is part of) and namespace (where the actor is named)."""

    def __init__(
        self,
        fingerprint: str,
        block_shape: Sequence[int],
        dtype: np.dtype,
        lease_s: float,
        address: str = "auto",
        namespace: str = "jaxserve",
    ) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, namespace=namespace, log_to_driver=False)
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = np.dtype(dtype)
        self.header = layout_header(self.block_shape, self.dtype)
        self.folder = f"ray://{namespace}/jaxserve-kv-{fingerprint}"  # for the logs
        actor = ray.remote(num_cpus=0)(_BlockActor)
        self._actor = actor.options(
            name=f"jaxserve-kv-{fingerprint}",
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
        ).remote(float(lease_s))
        self._ray = ray

    def _get(self, ref: Any) -> Any:
        return self._ray.get(ref)

    def contains(self, block_hash: BlockHash) -> bool:
        return self._get(self._actor.contains.remote(block_hash))

    def read_prefix(self, hashes: Sequence[BlockHash]) -> list[np.ndarray]:
        """The leading blocks of ``hashes`` the actor holds, in one call."""
        found = self._get(self._actor.get_prefix.remote(list(hashes), self.header))
        return [np.frombuffer(b, self.dtype).reshape(self.block_shape) for b in found]

    def count_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many of the leading ``hashes`` the actor holds, in one call, without reading."""
        return self._get(self._actor.count_prefix.remote(list(hashes), self.header))

    def read(self, block_hash: BlockHash) -> np.ndarray | None:
        found = self.read_prefix([block_hash])
        return found[0] if found else None

    def write(self, block_hash: BlockHash, data: np.ndarray) -> None:
        if data.shape != self.block_shape or data.dtype != self.dtype:
            raise ValueError(
                f"RayBlockStore.write: a block of shape {data.shape} {data.dtype}, expected "
                f"{self.block_shape} {self.dtype}"
            )
        payload = np.ascontiguousarray(data).tobytes()
        self._get(self._actor.put.remote(block_hash, self.header, payload))

    def kill(self) -> None:
        """End the actor and its blocks (a detached actor outlives the engines otherwise)."""
        self._ray.kill(self._actor)
