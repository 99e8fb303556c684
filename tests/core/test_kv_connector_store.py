"""The KV connector's host side, no jax: BlockStore (round trips in float and FP8, atomic
writes, leases, layouts kept apart), SharedStorageConnector's lookups, and KVTransferConfig's
checks."""

from __future__ import annotations

import os
import time

import ml_dtypes
import numpy as np
import pytest

from jaxserve.core.kv_connector.shared_storage import SharedStorageConnector
from jaxserve.core.kv_connector.store import BlockStore
from jaxserve.kv_transfer_config import KVTransferConfig

SHAPE = (2, 2, 1, 4, 8)  # [L, 2, K, P, H]


def _store(tmp_path, dtype=np.float32, fingerprint="m", lease_s=60.0) -> BlockStore:
    return BlockStore(str(tmp_path), fingerprint, SHAPE, np.dtype(dtype), lease_s)


def _block(seed: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
def test_a_block_comes_back_bit_for_bit(tmp_path, dtype):
    store = _store(tmp_path, dtype)
    block = _block(0, dtype)
    assert store.read(b"h" * 32) is None and not store.contains(b"h" * 32)
    store.write(b"h" * 32, block)
    back = store.read(b"h" * 32)
    assert store.contains(b"h" * 32)
    assert back.dtype == block.dtype and back.tobytes() == block.tobytes()


def test_partial_foreign_and_expired_files_are_not_read(tmp_path):
    store = _store(tmp_path)
    store.write(b"a" * 32, _block(1))
    # a writer killed mid-write leaves only its temporary file: the block is not there
    with open(os.path.join(store.folder, (b"b" * 32).hex() + ".99.tmp"), "wb") as f:
        f.write(store.header + b"\0" * 10)
    assert store.read(b"b" * 32) is None
    # a truncated or foreign file (another layout) is refused, not misread
    with open(os.path.join(store.folder, (b"c" * 32).hex()), "wb") as f:
        f.write(store.header + b"\0" * 10)
    assert store.read(b"c" * 32) is None
    other = BlockStore(str(tmp_path), "m", (1, 2, 1, 4, 8), np.dtype(np.float32), 60.0)
    assert other.read(b"a" * 32) is None  # same folder, another shape: refused
    assert _store(tmp_path, fingerprint="other-model").read(b"a" * 32) is None
    # past its lease a block is neither read nor kept
    old = time.time() - 120
    os.utime(os.path.join(store.folder, (b"a" * 32).hex()), (old, old))
    assert store.read(b"a" * 32) is None and not store.contains(b"a" * 32)
    assert store.sweep(force=True) == 1  # the expired block; the fresh files stay
    with pytest.raises(ValueError, match="expected"):
        store.write(b"d" * 32, _block(2)[:1])


def test_a_lookup_stops_at_the_first_block_the_store_lacks(tmp_path):
    store = _store(tmp_path)
    for i in (0, 1, 3):
        store.write(bytes([i]) * 32, _block(i))
    hashes = [bytes([i]) * 32 for i in range(4)]
    sync = KVTransferConfig(kv_role="kv_consumer", load_async=False)
    found = SharedStorageConnector(sync, store, 4).lookup(hashes)
    assert len(found) == 2 and found[1].tobytes() == _block(1).tobytes()
    # asynchronous loads: the lookup only counts the blocks there (the runner reads them)
    consumer = SharedStorageConnector(KVTransferConfig(kv_role="kv_consumer"), store, 4)
    assert consumer.lookup(hashes) == [None, None] and store.count_prefix(hashes) == 2
    producer = SharedStorageConnector(KVTransferConfig(kv_role="kv_producer"), store, 4)
    assert producer.lookup(hashes) == []


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"kv_connector": "NixlConnector"}, "kv_connector"),
        ({"kv_role": "decoder"}, "kv_role"),
        ({"kv_load_failure_policy": "abort"}, "not supported"),
        ({"kv_connector_extra_config": {"load_async": 1}}, "load_async"),
        ({"kv_connector_extra_config": {"lease_s": 0}}, "lease_s"),
        ({"kv_connector_extra_config": {"path": "/x"}}, "unknown keys"),
        ({"kv_rank": 0}, "unknown keys"),
    ],
)
def test_bad_kv_transfer_configs_are_refused_by_name(value, says):
    with pytest.raises(ValueError, match=says):
        KVTransferConfig.from_value(value)


def test_kv_transfer_config_from_vllms_dict():
    config = KVTransferConfig.from_value(
        {"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer",
         "kv_connector_extra_config": {"shared_storage_path": "/tmp/x", "lease_s": 5}}
    )  # fmt: skip
    assert config.loads and not config.saves and config.path == "/tmp/x" and config.lease_s == 5
    assert KVTransferConfig.from_value(None) is None
    with pytest.raises(TypeError, match="dict"):
        KVTransferConfig.from_value("shared")


def test_kv_transfer_params_are_checked_by_name():
    from jaxserve import SamplingParams
    from jaxserve.kv_transfer_config import check_params_for, expected_remote_tokens

    params = {"do_remote_prefill": True, "remote_num_tokens": 32}
    sp = SamplingParams(kv_transfer_params=params)
    assert expected_remote_tokens(sp.clone().kv_transfer_params) == 32
    assert expected_remote_tokens({"do_remote_decode": True}) == 0
    for bad, error, says in (
        ({"remote_engine_id": "x"}, ValueError, "unknown keys \\['remote_engine_id'\\]"),
        ({"remote_num_tokens": -1}, ValueError, "remote_num_tokens'\\] must be >= 0"),
        ({"remote_num_tokens": True}, TypeError, "must be an int"),
        ({"do_remote_decode": 1}, TypeError, "do_remote_decode'\\] must be a bool"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, ValueError, "exclusive"),
        ([1], TypeError, "must be a dict"),
    ):
        with pytest.raises(error, match=says):
            SamplingParams(kv_transfer_params=bad)
    consumer = KVTransferConfig(kv_role="kv_consumer")
    check_params_for(params, consumer, True)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        check_params_for(params, consumer, False)
    with pytest.raises(ValueError, match="kv_producer"):
        check_params_for({"do_remote_decode": True}, consumer, True)
    with pytest.raises(ValueError, match="kv_consumer"):
        check_params_for(params, None, True)
