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

A request's ``kv_transfer_params`` (vLLM's, in the completion body; SamplingParams here) say
what it expects of the connector: a prefill (``do_remote_decode``) answers with the params its
decode passes on (``do_remote_prefill``, ``remote_num_tokens``), and a consumer that cannot
find that many of the prompt's tokens recomputes them or fails the request, as
``kv_load_failure_policy`` says. ``check_kv_transfer_params`` checks them.
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
    "JaxTransferConnector": "jax_transfer",
    "jax_transfer": "jax_transfer",
}
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
_KEYS = ("kv_connector", "kv_role", "kv_load_failure_policy", "kv_connector_extra_config")
# kv_connector_extra_config keys: those every connector reads, and each transport's own (a key
# of another transport is refused: it would be silently ignored).
_COMMON_EXTRA_KEYS = ("lease_s", "load_async")
_TRANSPORT_EXTRA_KEYS = {
    "shared_storage": ("shared_storage_path",),
    "ray": ("ray_address", "ray_namespace"),
    "jax_transfer": (
        "transfer_host",
        "transfer_port",
        "pull_timeout_s",
        "max_held_offers_fraction",
    ),
}
# A request's kv_transfer_params: key -> (type, meaning).
KV_TRANSFER_PARAMS = {
    "do_remote_decode": (bool, "a prefill whose KV a decode server loads: its answer says how"),
    "do_remote_prefill": (bool, "the prompt's KV was computed by a prefill server"),
    "remote_num_tokens": (int, "prompt tokens of KV the prefill server stored"),
    # JaxTransferConnector's: where and what to pull (the producer's answer; checked there).
    "remote_host": (str, "the producer's transfer server host"),
    "remote_port": (int, "the producer's transfer server port"),
    "remote_transfer_id": (int, "the id the producer offers the prompt's KV under"),
    "remote_layout": (str, "the producer's KV layout fingerprint (model, block, dtype, TP)"),
    "remote_block_hash": (str, "hex prefix hash of the last block offered"),
    "remote_expires_at": (float, "Unix time the producer's offer (its lease) ends"),
}
_TYPE_NAMES = {bool: "a bool", int: "an int", str: "a string", float: "a number"}


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
        "JaxTransferConnector" (alias "jax_transfer"): no store; a producer offers each
        prefill's prompt KV on its device through jax.experimental.transfer and the consumer
        pulls it device to device (core/kv_connector/transfer.py); asynchronous loads only.
    kv_role: "kv_producer" saves its prompts' blocks, "kv_consumer" loads them, "kv_both" does
        both.
    kv_load_failure_policy: what a consumer does when a request's expected KV (its
        kv_transfer_params' ``remote_num_tokens``) cannot be loaded (missing, expired,
        unreadable, of another layout): "recompute" computes it and what follows; "fail" ends
        the request with finish_reason "error" (the server answers 500, naming the policy).
    shared_storage_path: the store's folder (kv_connector_extra_config; default
        default_storage_path()); each model and KV layout has a subfolder of its own.
    lease_s: seconds a saved block stays in the store for consumers (> 0); a producer deletes
        its older blocks as it saves new ones. JaxTransferConnector: how long an offer's
        gathered copy may wait for its pull, holding device memory until then (or until
        max_held_offers_fraction releases it).
    ray_address, ray_namespace: the Ray cluster to join ("auto": this host's) and the
        namespace of the store's actor ("RayStoreConnector" only).
    transfer_host, transfer_port: "JaxTransferConnector" only: where the engine's
        jax.experimental.transfer server listens, and the address a producer's answer names
        (so a host other consumers can reach; port 0: any free port).
    pull_timeout_s: "JaxTransferConnector" only: the longest a consumer waits for one pull
        before the load counts as failed (a producer that hangs).
    max_held_offers_fraction: "JaxTransferConnector" only: the most device memory a
        producer's offers (their gathered copies, padded) may hold at once, as a fraction of
        its KV cache's pages (0 < value <= 1; max_held_blocks). The memory plan reserves it
        beside the pool (runner/offer_reserve.py): a producer's pool is smaller by about
        1 / (1 + value) than a consumer's. An offer past it
        releases the oldest ones first (their consumers recompute or fail, as
        kv_load_failure_policy says); a prompt whose copy alone is larger is not offered (its
        decode computes it).
    load_async: a consumer's loads run in the background (the runner reads the store in a
        thread; the request waits in WAITING_FOR_REMOTE_KVS, and the engine steps on); False:
        the scheduler reads the blocks when it admits the request and they are written before
        that step's forward.
    """

    kv_connector: str = "SharedStorageConnector"
    kv_role: str = "kv_both"
    kv_load_failure_policy: str = "recompute"
    shared_storage_path: str = ""
    lease_s: float = 600.0
    ray_address: str = "auto"
    ray_namespace: str = "jaxserve"
    load_async: bool = True
    transfer_host: str = "127.0.0.1"
    transfer_port: int = 0
    pull_timeout_s: float = 30.0
    max_held_offers_fraction: float = 0.5

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
                f"is not supported; choose from {list(KV_LOAD_FAILURE_POLICIES)}"
            )
        if not isinstance(self.load_async, bool):
            raise ValueError(
                f"kv_transfer_config load_async must be a bool, got {self.load_async!r}"
            )
        lease = self.lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not lease > 0:
            raise ValueError(f"kv_transfer_config lease_s must be a number > 0, got {lease!r}")
        self._check_transfer()
        if not isinstance(self.shared_storage_path, str):
            raise ValueError(
                "kv_transfer_config shared_storage_path must be a string, got "
                f"{self.shared_storage_path!r}"
            )

    def _check_transfer(self) -> None:
        if self.transport == "jax_transfer" and not self.load_async:
            raise ValueError(
                "kv_transfer_config load_async=False: JaxTransferConnector loads "
                "asynchronously only (a pull runs in the runner's thread)"
            )
        if not isinstance(self.transfer_host, str) or not self.transfer_host:
            raise ValueError(
                f"kv_transfer_config transfer_host must be a host name, got {self.transfer_host!r}"
            )
        port = self.transfer_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(
                f"kv_transfer_config transfer_port must be in [0, 65535], got {port!r}"
            )
        wait = self.pull_timeout_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait > 0:
            raise ValueError(
                f"kv_transfer_config pull_timeout_s must be a number > 0, got {wait!r}"
            )
        held = self.max_held_offers_fraction
        if isinstance(held, bool) or not isinstance(held, (int, float)) or not 0 < held <= 1:
            raise ValueError(
                "kv_transfer_config max_held_offers_fraction must be a number in (0, 1], got "
                f"{held!r}"
            )

    @property
    def transport(self) -> str:
        """ "shared_storage", "ray" or "jax_transfer"."""
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
        top = {k: v for k, v in value.items() if k != "kv_connector_extra_config"}
        transport = KV_CONNECTORS.get(top.get("kv_connector", cls.kv_connector))
        known = _COMMON_EXTRA_KEYS + _TRANSPORT_EXTRA_KEYS.get(transport, ())
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config has unknown keys {unknown} for kv_connector "
                f"{top.get('kv_connector', cls.kv_connector)!r}; known: {list(known)}"
            )
        return cls(**top, **extra)


def max_held_blocks(fraction: float, num_kv_blocks: int, copy_ratio: int) -> int:
    """The most gathered blocks (padded) a producer's offers may hold: ``fraction`` of the
    device memory of its pool of ``num_kv_blocks`` pages, a gathered block costing
    ``copy_ratio`` pool blocks a device (tp when the pages are sharded over tp devices: the
    copies are replicated); at least 1. The transfer worker's cap and the memory plan's
    reserve both."""
    return max(1, int(fraction * num_kv_blocks / copy_ratio))


def check_kv_transfer_params(value: Any) -> dict[str, Any] | None:
    """A request's kv_transfer_params, checked (a copy), or None.

    Raises:
        TypeError: not a dict, or a value of the wrong type (named).
        ValueError: an unknown key (the known ones named), or a negative remote_num_tokens.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"SamplingParams.kv_transfer_params must be a dict, got {value!r}")
    unknown = sorted(set(value) - set(KV_TRANSFER_PARAMS))
    if unknown:
        raise ValueError(
            f"SamplingParams.kv_transfer_params has unknown keys {unknown}; jaxserve's "
            f"connector knows {list(KV_TRANSFER_PARAMS)}"
        )
    for key, item in value.items():
        kind = KV_TRANSFER_PARAMS[key][0]
        kinds = (int, float) if kind is float else kind
        if not isinstance(item, kinds) or (kind is not bool and isinstance(item, bool)):
            raise TypeError(
                f"SamplingParams.kv_transfer_params[{key!r}] must be {_TYPE_NAMES[kind]}, "
                f"got {item!r}"
            )
    if value.get("remote_num_tokens", 0) < 0:
        raise ValueError(
            "SamplingParams.kv_transfer_params['remote_num_tokens'] must be >= 0, got "
            f"{value['remote_num_tokens']}"
        )
    if value.get("do_remote_decode") and value.get("do_remote_prefill"):
        raise ValueError(
            "SamplingParams.kv_transfer_params: do_remote_decode and do_remote_prefill are "
            "exclusive (a request is either a prefill for a decode server or a decode)"
        )
    return dict(value)


def expected_remote_tokens(params: dict[str, Any] | None) -> int:
    """Prompt tokens of KV a request's kv_transfer_params promise it (0: none promised)."""
    if not params or not params.get("do_remote_prefill"):
        return 0
    return int(params.get("remote_num_tokens", 0))


def check_params_for(
    params: dict[str, Any] | None, config: KVTransferConfig | None, enable_prefix_caching: bool
) -> None:
    """Raise ValueError unless an engine of ``config`` can honour a request's (checked)
    kv_transfer_params: a prefill for a decode server needs a connector that saves, a decode
    of a remote prefill one that loads (and prefix caching, through which it loads)."""
    if not params:
        return
    if params.get("do_remote_decode") and (config is None or not config.saves):
        raise ValueError(
            "SamplingParams.kv_transfer_params do_remote_decode needs an engine whose KV "
            "connector saves (kv_transfer_config kv_role 'kv_producer' or 'kv_both')"
        )
    if params.get("do_remote_prefill"):
        if config is None or not config.loads:
            raise ValueError(
                "SamplingParams.kv_transfer_params do_remote_prefill needs an engine whose KV "
                "connector loads (kv_transfer_config kv_role 'kv_consumer' or 'kv_both')"
            )
        if not enable_prefix_caching:
            raise ValueError(
                "SamplingParams.kv_transfer_params do_remote_prefill needs "
                "enable_prefix_caching=True (the KV connector loads through the prefix cache)"
            )
