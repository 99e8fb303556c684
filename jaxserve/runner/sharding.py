"""Tensor parallelism: the device mesh, and where params, KV pages and step inputs live.

One 1-D mesh with the axis "tp" over `tensor_parallel_size` devices. The step function is the
same as on one device; GSPMD partitions it from the shardings fixed here:

    params      the model's param_partition_specs(tp): Megatron layout (heads, MLP columns and
                vocab sharded; norms replicated), placed shard by shard while loading
    KV pages    [K, S, P, H] per layer, sharded on K when tp | K, else replicated
    host inputs (token ids, attention and sampling metadata) replicated
    outputs     sampled ids and logprobs replicated; the KV pages keep their sharding

Every jitted argument and result has an explicit sharding, identical in warm-up and serving,
so a sharding never causes a recompilation.

KV heads fewer than devices (K < tp, e.g. K = 2 on 8 devices). The KV projections and pages
are replicated: each device computes and stores every KV head and reads the ones its query
heads use. The alternative, repeating each KV head tp / K times so that each device stores one
head (vLLM's choice), needs the model to run with K' = tp heads and the weights rewritten at
load time. Replication keeps one model definition and one checkpoint layout; its cost is KV
memory: each device holds K heads instead of 1, i.e. K times fewer pages fit per device (the
pool is sized per device, so this shows up as a smaller `num_kv_blocks`, never as an error).
The k/v projections it recomputes are 2K/N of the attention projections' FLOPs (2/8 for an
8:2 GQA model), small next to the MLP.

Attention under TP runs the plan's kernel per device inside shard_map (a Pallas or FFI kernel
is a custom call that GSPMD cannot partition): query heads split on N, pages on K, or both
replicated when tp divides neither (shard_heads in ragged_paged_attention/impl.py). When tp
splits the query heads but not the KV heads, a device would need part of the replicated pages,
which a kernel cannot take without copying them every step: there the plan takes the
reference, which GSPMD partitions, and logs why.

Multi-host. The mesh spans processes when jax's own distributed runtime is up: call

    jax.distributed.initialize(coordinator_address="host0:1234", num_processes=P, process_id=i)

in every process before anything else touches jax (on Cloud TPU and SLURM the arguments are
detected), then build the same LLM(..., tensor_parallel_size=jax.device_count()) in every
process and feed every process the same requests: each runs the same host scheduler, so the
jitted steps line up, and `jax.devices()` lists the devices of every process in the same
order. Host inputs are numpy arrays identical in every process, which jit places into the
replicated sharding; outputs are fully replicated, so every process reads the sampled tokens
from its own devices. Every process must issue its cross-process computations in the same
order: the weights load beside the runner's build issuing none (each process places its own
shards: checkpoints_tools/checkpoint.place), an Orbax checkpoint's before it
(factory._weights_first), and a background warm-up is refused (factory._check_processes).
On CPU, jax.config.update("jax_cpu_collectives_implementation", "gloo")
gives the cross-process collectives (tests/runner/test_tensor_parallel.py runs two processes on
127.0.0.1 this way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxserve.models import TP_AXIS, CausalLM


def make_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh, axis "tp", over the first `tensor_parallel_size` of `devices` (default:
    jax.devices(), every process's devices after jax.distributed.initialize).

    Raises:
        ValueError: tensor_parallel_size < 1 or more than the devices there are; or, with
            several processes, a mesh that leaves some process without a device (every process
            must take part in every step).
    """
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size < 1 or tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} must be between 1 and the number of "
            f"devices ({len(devices)}: {devices[0].platform})"
        )
    chosen = devices[:tensor_parallel_size]
    if jax.process_count() > 1 and {d.process_index for d in chosen} != set(
        range(jax.process_count())
    ):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} leaves some of the "
            f"{jax.process_count()} processes without a device; with several processes use "
            f"tensor_parallel_size=jax.device_count() ({jax.device_count()})"
        )
    if len(chosen) == len(jax.devices()):
        # make_mesh orders the devices along the physical interconnect (TPU torus, ...). Auto
        # axes: GSPMD propagates the shardings (make_mesh's default, Explicit, would ask every
        # ambiguous op, such as the vocab-sharded embedding gather, for an out_sharding).
        return jax.make_mesh(
            (len(chosen),), (TP_AXIS,), axis_types=(AxisType.Auto,), devices=chosen
        )
    return Mesh(np.array(chosen), (TP_AXIS,), axis_types=(AxisType.Auto,))


@dataclass(frozen=True)
class ShardingPlan:
    """Where everything of one model lives on one mesh.

    mesh: the 1-D "tp" mesh.
    param_specs: PartitionSpec pytree matching the params (CausalLM.param_partition_specs(tp)).
    kv_spec: PartitionSpec of each layer's [K, S, P, H] K pages and V pages.
    """

    mesh: Mesh
    param_specs: Any
    kv_spec: PartitionSpec

    @property
    def tp_size(self) -> int:
        return self.mesh.shape[TP_AXIS]

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def kv_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.kv_spec)

    @property
    def kv_is_sharded(self) -> bool:
        return self.kv_spec[0] == TP_AXIS

    def param_sharding(self, path: tuple[str, ...]) -> NamedSharding:
        """The sharding of the parameter at key path `path`, e.g. ("layers_0", "attn",
        "q_proj"): a checkpoints_tools.ParamSharding.

        Raises:
            KeyError: no such parameter.
        """
        spec = self.param_specs
        for key in path:
            spec = spec[key]
        if not isinstance(spec, PartitionSpec):
            raise KeyError(f"{'/'.join(path)} is not a parameter")
        return NamedSharding(self.mesh, spec)

    def param_shardings(self) -> Any:
        """NamedSharding pytree matching the params."""
        return jax.tree_util.tree_map(
            lambda spec: NamedSharding(self.mesh, spec),
            self.param_specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def kv_shardings(self, num_layers: int) -> list[tuple[NamedSharding, NamedSharding]]:
        """Shardings matching the kv_caches list: (K pages, V pages) per layer."""
        return [(self.kv_sharding, self.kv_sharding)] * num_layers

    def kv_bytes_per_block(self, model: CausalLM, block_size: int, dtype: Any) -> int:
        """KV bytes one block takes on each device (all layers, K and V)."""
        total = model.kv_cache_bytes_per_block(block_size, dtype)
        return total // self.tp_size if self.kv_is_sharded else total


def plan_sharding(model: CausalLM, mesh: Mesh) -> ShardingPlan:
    """The ShardingPlan of `model` on `mesh` (a group tp does not divide is replicated).

    Raises:
        ValueError: the mesh has no "tp" axis, or other axes.
    """
    if mesh.axis_names != (TP_AXIS,):
        raise ValueError(f"the mesh must have the one axis {TP_AXIS!r}, got {mesh.axis_names}")
    tp = mesh.shape[TP_AXIS]
    return ShardingPlan(
        mesh=mesh,
        param_specs=model.param_partition_specs(tp),
        kv_spec=model.kv_cache_partition_spec(tp),
    )


def per_device_bytes(arrays: Any) -> int:
    """Bytes the leaves of `arrays` (jax.Arrays) take on one device: the largest shard of each
    (replicated leaves count whole)."""
    total = 0
    for x in jax.tree_util.tree_leaves(arrays):
        shard_shape = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard_shape)) * x.dtype.itemsize
    return total
