"""BlockStore: KV blocks in files that every engine on the host can read, one file per block,
named by the block's prefix hash, in a folder of the model and KV layout's own (so engines of
different models or layouts never read each other's blocks).

A file is a 64-byte ASCII header (format, dtype, shape) and the block's raw bytes
([L, 2, K, P, H] in the pages' dtype: float or FP8 alike). It is written to a temporary name and
renamed into place, so a reader sees a whole block or none, even when the writer is killed
mid-write. A block is leased for ``lease_s`` seconds from its write: older files are not read and
are deleted by the next writer's sweep. In /dev/shm the files are shared memory.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence

import numpy as np

from jaxserve.core.kv_cache_utils import BlockHash

logger = logging.getLogger("jaxserve")

_HEADER_BYTES = 64
_MAGIC = "JXKV1"


def layout_header(block_shape: Sequence[int], dtype: np.dtype) -> bytes:
    """The 64-byte header naming a block's format, dtype and shape (a reader of another
    layout refuses the block)."""
    shape = ",".join(str(int(d)) for d in block_shape)
    header = f"{_MAGIC} {np.dtype(dtype).name} {shape}\n".encode()
    if len(header) > _HEADER_BYTES:
        raise ValueError(f"a block header of {len(header)} bytes does not fit")
    return header.ljust(_HEADER_BYTES, b" ")


class BlockStore:
    """Args:
    root: the shared folder (created if missing).
    fingerprint: names the model and KV layout: the subfolder of these blocks.
    block_shape: (L, 2, K, P, H) of one block.
    dtype: the pages' numpy dtype.
    lease_s: seconds a block stays readable after its write.
    """

    def __init__(
        self,
        root: str,
        fingerprint: str,
        block_shape: Sequence[int],
        dtype: np.dtype,
        lease_s: float,
    ) -> None:
        self.folder = os.path.join(root, fingerprint)
        os.makedirs(self.folder, exist_ok=True)
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = np.dtype(dtype)
        self.lease_s = float(lease_s)
        self.block_bytes = math.prod(self.block_shape) * self.dtype.itemsize
        self.header = layout_header(self.block_shape, self.dtype)
        self._next_sweep = 0.0

    def _path(self, block_hash: BlockHash) -> str:
        return os.path.join(self.folder, block_hash.hex())

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether the block is stored and its lease has not expired."""
        try:
            return time.time() - os.stat(self._path(block_hash)).st_mtime < self.lease_s
        except OSError:
            return False

    def read(self, block_hash: BlockHash) -> np.ndarray | None:
        """The block [L, 2, K, P, H], or None: missing, expired, or not this layout (logged)."""
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                if time.time() - os.fstat(f.fileno()).st_mtime >= self.lease_s:
                    return None
                raw = f.read()
        except OSError:
            return None
        if raw[:_HEADER_BYTES] != self.header or len(raw) != _HEADER_BYTES + self.block_bytes:
            logger.warning("KV store: %s is not a block of this layout; not loaded", path)
            return None
        data = np.frombuffer(raw, self.dtype, offset=_HEADER_BYTES)
        return data.reshape(self.block_shape)

    def read_prefix(self, hashes: Sequence[BlockHash]) -> list[np.ndarray]:
        """The leading blocks of ``hashes`` this store holds (read until the first it lacks)."""
        found = []
        for block_hash in hashes:
            data = self.read(block_hash)
            if data is None:
                break
            found.append(data)
        return found

    def count_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many of the leading ``hashes`` this store holds (unexpired), without reading."""
        num = 0
        for block_hash in hashes:
            if not self.contains(block_hash):
                break
            num += 1
        return num

    def write(self, block_hash: BlockHash, data: np.ndarray) -> None:
        """Store a block (atomically: a reader sees it whole or not at all); renews its lease."""
        if data.shape != self.block_shape or data.dtype != self.dtype:
            raise ValueError(
                f"BlockStore.write: a block of shape {data.shape} {data.dtype}, expected "
                f"{self.block_shape} {self.dtype}"
            )
        final = self._path(block_hash)
        temp = f"{final}.{os.getpid()}.tmp"
        with open(temp, "wb") as f:
            f.write(self.header)
            f.write(np.ascontiguousarray(data).tobytes())
        os.replace(temp, final)
        self.sweep()

    def sweep(self, force: bool = False) -> int:
        """Delete blocks past their lease (at most every lease_s / 4 seconds unless forced).
        Returns the number deleted."""
        now = time.time()
        if not force and now < self._next_sweep:
            return 0
        self._next_sweep = now + self.lease_s / 4
        deleted = 0
        with os.scandir(self.folder) as entries:
            for entry in entries:
                try:
                    if now - entry.stat().st_mtime >= self.lease_s:
                        os.unlink(entry.path)
                        deleted += 1
                except OSError:  # another engine deleted it first
                    continue
        return deleted
