"""KVTransferConfig: vLLM's ``kv_transfer_config`` dict, validated (host side, no jax).

``LLM(..., kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role":
"kv_producer"})`` (``jaxserve serve --kv-transfer-config JSON``) connects the engine to a KV
store other engines share (core/kv_connector/): a producer saves its prompts' full KV blocks
there as it computes them; a consumer's prefix lookup goes on into the store past its own device
and host caches and loads the blocks it finds instead of computing them. Blocks are keyed by
their prefix hash (the same in every process), so a consumer needs no word from the producer:
a request whose prompt a producer has prefilled finds its blocks by itself. Every key is checked
before anything loads; an unknown key or a bad value is a ValueError naming the key, the value
and the limit.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

# vLLM's connector names for what jaxserve implements, and the short names.
KV_CONNECTORS = {
    "SharedStorageConnector": "shared_storage",
    "shared_storage": "shared_storage",
    "RayStoreConnector": "ray",
    "ray": "ray",
}
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute",)
_KEYS = ("kv_connector", "kv_role", "kv_load_failure_policy", "kv_connector_extra_config")
_EXTRA_KEYS = ("shared_storage_path", "lease_s", "ray_address", "ray_namespace")


def default_storage_path() -> str:
    """/dev/shm/jaxserve-kv (shared memory) where it exists, else the temp folder's."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "jaxserve-kv")


@dataclass(frozen=True)
class KVTransferConfig:
    """The KV connector's settings (vLLM's names).

    kv_connector: "SharedStorageConnector" (alias "shared_storage"): one host's engines share
        a folder of block files, in shared memory by default (core/kv_connector/store.py).
        "RayStoreConnector" (alias "ray"): the engines of one Ray cluster, on any of its hosts,
        share a named Ray actor holding the blocks (core/kv_connector/ray_store.py).
    kv_role: "kv_producer" saves its prompts' blocks, "kv_consumer" loads them, "kv_both" does
        both.
    kv_load_failure_policy: what a consumer does with a block it cannot load (missing, expired,
        unreadable, of another layout): "recompute" computes it and what follows. vLLM's "fail"
        is refused: failing a request needs its kv_transfer_params, which jaxserve's requests do
        not carry.
    shared_storage_path: the store's folder (kv_connector_extra_config; default
        default_storage_path()); each model and KV layout has a subfolder of its own.
    lease_s: seconds a saved block stays in the store for consumers (> 0); a producer deletes
        its older blocks as it saves new ones.
    ray_address, ray_namespace: the Ray cluster to join ("auto": this host's) and the
        namespace of the store's actor ("RayStoreConnector" only).
    """

    kv_connector: str = "SharedStorageConnector"
    kv_role: str = "kv_both"
    kv_load_failure_policy: str = "recompute"
    shared_storage_path: str = ""
    lease_s: float = 600.0
    ray_address: str = "auto"
    ray_namespace: str = "jaxserve"

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config['kv_connector']={self.kv_connector!r} is not one jaxserve "
                f"implements; choose from {sorted(KV_CONNECTORS)}"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config['kv_role']={self.kv_role!r}; choose from {list(KV_ROLES)}"
            )
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_transfer_config['kv_load_failure_policy']={self.kv_load_failure_policy!r} "
                f"is not supported; choose from {list(KV_LOAD_FAILURE_POLICIES)} ('fail' needs "
                "per-request kv_transfer_params, which jaxserve requests do not carry)"
            )
        lease = self.lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not lease > 0:
            raise ValueError(f"kv_transfer_config lease_s must be a number > 0, got {lease!r}")
        if not isinstance(self.shared_storage_path, str):
            raise ValueError(
                "kv_transfer_config shared_storage_path must be a string, got "
                f"{self.shared_storage_path!r}"
            )

    @property
    def transport(self) -> str:
        """ "shared_storage" or "ray"."""
        return KV_CONNECTORS[self.kv_connector]

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def path(self) -> str:
        return self.shared_storage_path or default_storage_path()

    @classmethod
    def from_value(cls, value: Any) -> KVTransferConfig | None:
        """None (no connector), a KVTransferConfig, or vLLM's dict.

        Raises:
            TypeError: not a dict.
            ValueError: an unknown key (the known ones named) or a bad value.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"kv_transfer_config must be a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown keys {unknown}; known: {list(_KEYS)}")
        extra = value.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config['kv_connector_extra_config'] must be a dict")
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config has unknown keys {unknown}; known: {list(_EXTRA_KEYS)}"
            )
        top = {k: v for k, v in value.items() if k != "kv_connector_extra_config"}
        return cls(**top, **extra)
