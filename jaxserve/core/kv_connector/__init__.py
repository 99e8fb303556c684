"""The KV connector: KV blocks shared between engines (disaggregated prefill and decode), the
scheduler's half here (no jax), the runner's in runner/kv_connector_worker.py.

    base.py            KVConnectorMeta, the step's hand-off to the runner (loads and saves)
    store.py           BlockStore: block files keyed by prefix hash, written atomically, leased
    shared_storage.py  SharedStorageConnector: lookups past the local caches, saves of prompt
                       blocks as they are computed
    transfer.py        TransferConnector: a prefill's prompt KV offered on the producer's device
                       and pulled device to device by the consumer (jax.experimental.transfer;
                       the runner's half is runner/kv_transfer_worker.py)
"""
