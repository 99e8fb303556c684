"""``AttentionImpl``: one chosen kernel with its static options, called like the kernel itself.

Models hold it as static configuration and call it like a function, so nothing below the
engine's execution plan sees a backend name. Under tensor parallelism it runs the kernel per
device inside ``shard_map`` (``shard_heads``) where the kernel allows it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxserve.pallas_kernels.ragged_paged_attention.kernels import KERNELS, KernelSpec

NUM_ARRAY_ARGS = 7  # q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
    """One ragged paged attention implementation with its static options; call it with the
    signature of ``signature.AttentionKernel``.

    name: the attention_backend name it is reported under ("pallas_tpu", "cpu", ...).
    kernel: the key of its KernelSpec in KERNELS.
    interpret: run the Pallas kernel in interpret mode (tests off its platform).
    num_cores: GPU streaming multiprocessors, for the GPU kernels' tuning (None: a default).
    soft_fp8: convert float8_e4m3fn pages with integer ops (Target.converts_e4m3 is False:
        GPUs below sm_89); the kernels that take the option (Triton) read it.
    mesh, axis: under tensor parallelism, the mesh and its axis; the kernel then runs per
        device inside shard_map, on the device's query heads and their KV heads.
    """

    name: str
    kernel: str
    interpret: bool = False
    num_cores: int | None = None
    soft_fp8: bool = False
    mesh: Mesh | None = None
    axis: str | None = None

    @property
    def spec(self) -> KernelSpec:
        return KERNELS[self.kernel]

    @property
    def length_bounded(self) -> bool:
        return self.spec.length_bounded

    def __call__(
        self,
        q: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        kv_lens: jax.Array,
        block_tables: jax.Array,
        cu_q_lens: jax.Array,
        num_seqs: jax.Array,
        *,
        sm_scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        k_scale: jax.Array | None = None,
        v_scale: jax.Array | None = None,
    ) -> jax.Array:
        local = functools.partial(
            self._local, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
        )
        args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
        # The scales travel as two more (replicated) positional arguments, or not at all.
        args += () if k_scale is None and v_scale is None else (k_scale, v_scale)
        if self.mesh is None or not self.spec.shard_map:
            return local(*args)
        heads = shard_heads(local, self.mesh, self.axis, q.shape[1], k_pages.shape[0], len(args))
        return heads(*args)

    def _local(self, *args, sm_scale, sliding_window, soft_cap) -> jax.Array:
        args, scales = args[:NUM_ARRAY_ARGS], args[NUM_ARRAY_ARGS:]
        options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
        if scales:
            options.update(k_scale=scales[0], v_scale=scales[1])
        spec = self.spec
        options.update(spec.fixed)
        options.update({name: getattr(self, name) for name in spec.options})
        return spec.entry()(*args, **options)


def shard_heads(
    fn: Callable[..., jax.Array],
    mesh: Mesh,
    axis: str,
    num_q_heads: int,
    num_kv_heads: int,
    num_args: int = NUM_ARRAY_ARGS,
) -> Callable[..., jax.Array]:
    """``fn`` run per device inside shard_map: each device attends with its slice of the query
    heads over its slice of the KV heads (the model's tensor-parallel layout: heads sharded
    where ``axis`` divides them, replicated where not). Metadata is replicated, and so are the
    arguments past the seventh (an FP8 cache's k_scale and v_scale: num_args 9).

    Raises:
        ValueError: the split does not nest (see head_split_refusal).
    """
    reason = head_split_refusal(num_q_heads, num_kv_heads, mesh.shape[axis])
    if reason is not None:
        raise ValueError(reason)
    tp = mesh.shape[axis]
    q_spec = PartitionSpec(None, axis, None) if num_q_heads % tp == 0 else PartitionSpec()
    kv_spec = PartitionSpec(axis) if num_kv_heads % tp == 0 else PartitionSpec()
    rep = PartitionSpec()
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, *(rep,) * (num_args - 3)),
        out_specs=q_spec,
        check_vma=False,
    )


def head_split_refusal(num_q_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why the per-device attention cannot run on ``tp`` devices, or None.

    Each device must hold whole GQA groups: its query heads and the KV heads they read. That
    holds when tp divides both N and K (each device: N / tp query heads, K / tp KV heads), or
    neither (everything replicated: each device computes every head). With tp | N but not K,
    the KV heads are replicated while the query heads are split, and a device would need a
    slice of the KV pages it cannot take without copying them every step: refused, so that
    "auto" takes the GSPMD-partitioned reference instead.
    """
    if tp == 1 or num_kv_heads % tp == 0 or num_q_heads % tp:
        return None
    return (
        f"tensor_parallel_size={tp} splits the {num_q_heads} query heads but not the "
        f"{num_kv_heads} KV heads: the per-device kernel would need part of the replicated KV "
        "pages"
    )
