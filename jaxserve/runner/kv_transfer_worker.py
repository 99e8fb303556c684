"""TransferWorker: the runner's half of ``kv_connector`` "JaxTransferConnector" (the
scheduler's half is core/kv_connector/transfer.py): this engine's jax.experimental.transfer
server, the producer's offers and the consumer's pulls.

Producer: after the forward that completes a prefill's prompt, its full blocks are gathered
into one array on the device (kv_transfer_copies.py, dispatched in step order, so it reads the
KV this forward wrote; the request's blocks may be reused once it finishes, the gathered copy
is what travels) and offered with ``await_pull`` under the offer's id, with the lease's end as
the server's timeout. The server drops the array after the pull; HeldOffers
(kv_transfer_offers.py) releases it when its lease ends (the server alone would only when the
next offer is made) or, oldest first, when the offers would hold more than
``max_held_offers_fraction`` of the KV cache's device memory (which the memory plan reserves:
offer_reserve.py).

Consumer: each LoadJob (its ``source`` a PullSource) is pulled in one of the worker's reader
threads (KVConnectorWorker's asynchronous loads): a fresh connection to the producer's server,
one pull of the offer's padded shape, waited for; then the first step dispatched after it
scatters the rows of the blocks the request lacks into its fresh blocks. A pull of a producer
that is gone would wait forever, and so would one of an offer the producer no longer holds: the
producer is first probed with a TCP connection (refused: nothing loads), an offer past its lease
is not pulled, an offer its producer released answers with an error at once, and a pull that
has not ended after ``pull_timeout_s`` is abandoned and its connection closed (PullGuard,
kv_transfer_pulls.py: the blocked threads stay bounded). Each loads nothing: the request's
promised KV is missing, and its kv_load_failure_policy applies (sched/remote_kv.py).
"""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from typing import Any

import jax
import numpy as np

from jaxserve.core.kv_connector.base import KVConnectorMeta, LoadJob
from jaxserve.core.kv_connector.transfer import PullSource, TransferConnector
from jaxserve.kv_transfer_config import KVTransferConfig, max_held_blocks
from jaxserve.runner.kv_connector_worker import KVCaches, KVConnectorWorker
from jaxserve.runner.kv_transfer_copies import TransferCopies
from jaxserve.runner.kv_transfer_offers import HeldOffers
from jaxserve.runner.kv_transfer_pulls import PullGuard
from jaxserve.runner.sharding import ShardingPlan

logger = logging.getLogger("jaxserve")

_PROBE_S = 2.0  # longest wait for a TCP connection to a producer's transfer server


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class TransferWorker(KVConnectorWorker):
    """Args:
    connector: the scheduler's half.
    copies: the gathers and scatters (``staging``: warm-up compiles them, the runner counts
        their compilations).
    server: this engine's jax.experimental.transfer server.
    pull_timeout_s: the longest one pull is waited for.
    max_held_blocks: the most gathered blocks (padded) its offers may hold at once.
    """

    # Pulls of several requests at once, each over its own connection: one slow or hung
    # producer does not hold up the loads from the others.
    num_reader_threads = 4

    def __init__(
        self,
        connector: TransferConnector,
        copies: TransferCopies,
        server: Any,
        pull_timeout_s: float,
        max_held_blocks: int,
    ) -> None:
        super().__init__(connector, copies)  # type: ignore[arg-type]
        self.server = server
        self.offers = HeldOffers(server, max_held_blocks)
        self.pulls = PullGuard(pull_timeout_s)
        connector.report_runner_stats(self.stats)

    def stats(self) -> dict[str, int]:
        """The held offers and the guarded pulls, in get_stats (and /metrics)."""
        return {
            "kv_transfer_offers_held": self.offers.num_held,
            "kv_transfer_offer_blocks_held": self.offers.held_blocks,
            "kv_transfer_offers_evicted": self.offers.num_evicted,
            "kv_transfer_offers_expired": self.offers.num_expired,
            "kv_transfer_pulls_abandoned": self.pulls.num_abandoned,
            "kv_transfer_pulls_refused": self.pulls.num_refused,
            "kv_transfer_pulls_stuck": self.pulls.num_stuck,
        }

    @property
    def num_abandoned_pulls(self) -> int:
        """Pulls still running after pull_timeout_s (monotonic)."""
        return self.pulls.num_abandoned

    # ---- producer -------------------------------------------------------------------------
    def save(self, kv_caches: KVCaches, meta: KVConnectorMeta) -> KVCaches:
        """Gather and offer the step's completed prompts (after the forward); the pages are
        only read."""
        for offer in meta.offers:
            data = self.staging.gather(kv_caches, offer.block_ids)
            self.offers.offer(offer.transfer_id, data, offer.expires_at)
        return kv_caches

    def close(self) -> None:
        """The engine shuts down: every held offer released (the lease thread stopped), the
        pulls under way abandoned, the reader threads stopped, and the transfer server
        dropped. jax's server has no close of its own: it stops listening, and its port is
        free again, once its last reference is gone, so nothing here keeps one. Idempotent."""
        if self.server is None:
            return
        self.offers.close()
        self.pulls.close()  # before the readers are waited for: their pulls end now
        super().close()
        self.server = self.offers.server = None

    # ---- consumer -------------------------------------------------------------------------
    def _read(self, job: LoadJob) -> jax.Array | None:
        """The job's offer pulled onto this device (in the reader thread), or None (logged)."""
        source: PullSource | None = job.source
        if source is None:  # not a pull the scheduler's half set up (logged, loads nothing)
            logger.warning("KV transfer: the load of %s names no offer", job.req_id)
            return None
        where = _host_port(source.host, source.port)
        if source.expires_at <= time.time():
            logger.warning("KV transfer: %s's offer on %s expired; not pulled", job.req_id, where)
            return None
        try:
            socket.create_connection((source.host, source.port), _PROBE_S).close()
        except OSError as e:
            logger.warning("KV transfer: producer %s of %s is gone (%s)", where, job.req_id, e)
            return None
        spec = self.staging.spec(source.num_blocks)

        def fetch(connection: Any) -> Any:
            (data,) = connection.pull(source.transfer_id, [spec])
            return jax.block_until_ready(data)

        what = f"pull of {job.req_id} from {where}"
        return self.pulls.pull(self.server.connect(where), fetch, what)

    def _write(self, kv_caches: KVCaches, job: LoadJob, data: Any) -> tuple[KVCaches, int]:
        """Scatter the pulled rows of the job's blocks (offered blocks ``first_block`` on)."""
        if data is None:
            return kv_caches, 0
        first = job.source.first_block
        block_ids = np.zeros(data.shape[0], np.int32)  # 0: a row not written
        block_ids[first : first + len(job.block_ids)] = job.block_ids
        return self.staging.scatter(kv_caches, data, block_ids), len(job.block_ids)


def make_transfer_connector(
    config: KVTransferConfig,
    model_name: str,
    num_layers: int,
    page_shape: tuple[int, int, int, int],
    dtype: Any,
    sharding: ShardingPlan | None,
) -> TransferWorker:
    """The JaxTransferConnector of ``config`` for pages ``page_shape`` (K, S, P, H) x
    ``num_layers`` of ``dtype``, its transfer server started on ``config.transfer_host``."""
    from jax.experimental import transfer  # only an engine with this connector needs it

    copies = TransferCopies(num_layers, page_shape, dtype, sharding)
    tp_size = sharding.tp_size if sharding is not None else 1
    layout = f"{model_name}|{copies.block_shape}|{copies.dtype.name}|tp{tp_size}"
    fingerprint = hashlib.sha256(layout.encode()).hexdigest()[:16]
    client = (sharding.mesh.devices.flat[0] if sharding is not None else jax.devices()[0]).client
    host = config.transfer_host
    try:  # one transport (data) socket per local device, as tpu-inference's servers have
        server = transfer.start_transfer_server(
            client,
            address=_host_port(host, config.transfer_port),
            transport_addresses=[_host_port(host, 0)] * jax.local_device_count(),
        )
    except Exception as e:
        raise RuntimeError(
            f"kv_connector 'JaxTransferConnector': jax.experimental.transfer could not start a "
            f"server on {_host_port(host, config.transfer_port)} for the {client.platform} "
            f"devices ({e})"
        ) from e
    port = int(server.address().rsplit(":", 1)[1])
    copy_ratio = tp_size if sharding is not None and sharding.kv_is_sharded else 1
    max_held = max_held_blocks(config.max_held_offers_fraction, page_shape[1], copy_ratio)
    connector = TransferConnector(config, page_shape[2], fingerprint, (host, port),
                                  max_offer_blocks=max_held)  # fmt: skip
    return TransferWorker(connector, copies, server, config.pull_timeout_s, max_held)
