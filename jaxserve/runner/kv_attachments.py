"""What the runner is given for its KV cache besides the pages, built from a resolved model:
an FP8 cache's scales (kv_scales.py, calibrated when the checkpoint has none), the host KV tier
(kv_offload.py) and the KV connector's worker (kv_connector_worker.py). factory.make_runner
passes each to the ModelRunner.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxserve.checkpoints_tools import LoadedCheckpoint
from jaxserve.models import CausalLM
from jaxserve.runner.kv_calibration import calculate_kv_scales
from jaxserve.runner.kv_connector_worker import KVConnectorWorker, make_kv_connector
from jaxserve.runner.kv_offload import KVOffloader
from jaxserve.runner.kv_scales import kv_scales_for
from jaxserve.runner.kv_transfer_worker import make_transfer_connector

if TYPE_CHECKING:
    from jaxserve.runner.factory import ResolvedModel

logger = logging.getLogger("jaxserve")


def kv_scales_of(resolved: ResolvedModel, model: CausalLM, ckpt: LoadedCheckpoint):
    """An FP8 KV cache's f32[L, 2] scales (kv_scales.py; None for pages in the model dtype):
    computed from a calibration pass when the checkpoint has none and calculate_kv_scales is
    on, unless the params are abstract (jaxserve/aot compiles: the scales are step data, their
    values change no compiled shape)."""
    concrete = all(isinstance(p, jax.Array) for p in jax.tree_util.tree_leaves(ckpt.params))
    calculate = None
    if resolved.config.cache.calculate_kv_scales and concrete:
        calculate = functools.partial(calculate_kv_scales, model, ckpt.params, resolved.sharding)
    return kv_scales_for(
        resolved.plan.kv_cache_dtype, ckpt.path, ckpt.arch.num_layers, calculate=calculate
    )


def kv_connector_of(model: CausalLM, resolved: ResolvedModel) -> KVConnectorWorker | None:
    """The KV connector of ``kv_transfer_config`` (kv_connector_worker.py), or None."""
    config = resolved.config
    if config.kv_transfer is None:
        return None
    cache = config.cache
    transfer = config.kv_transfer.transport == "jax_transfer"  # kv_transfer_worker.py
    make = make_transfer_connector if transfer else make_kv_connector
    worker = make(
        config.kv_transfer,
        config.model.model,
        model.arch.num_layers,
        model.kv_cache_shape(cache.num_kv_blocks, cache.block_size),
        jnp.dtype(resolved.plan.kv_cache_dtype),
        resolved.sharding,
    )
    logger.info(
        "KV connector: %s as %s, %s",
        config.kv_transfer.kv_connector,
        config.kv_transfer.kv_role,
        worker.connector.describe(),
    )
    return worker


def host_tier_of(model: CausalLM, resolved: ResolvedModel) -> KVOffloader | None:
    """The host KV tier (kv_offload.py) of ``resolved.num_host_blocks`` slots for the pages of
    ``model``, allocated here once (its size was checked before any weight was read:
    host_kv_blocks); None, and nothing allocated, for 0."""
    num_host_blocks = resolved.num_host_blocks
    if num_host_blocks == 0:
        return None
    cache = resolved.config.cache
    offload = KVOffloader(
        model.arch.num_layers,
        model.kv_cache_shape(cache.num_kv_blocks, cache.block_size),
        jnp.dtype(resolved.plan.kv_cache_dtype),
        num_host_blocks,
        resolved.sharding,
    )
    logger.info(
        "host KV tier: %d blocks of %d bytes (%.3g GiB)",
        num_host_blocks,
        offload.block_bytes,
        num_host_blocks * offload.block_bytes / (1 << 30),
    )
    return offload
