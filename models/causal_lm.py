"""CausalLM: the model object the runner uses, a thin pure-function face over the Flax Decoder.

    model = get_model(arch, dtype=jnp.bfloat16, attention=plan.attention)  # default: reference
    params = model.init_params(jax.random.key(0))            # or a loaded checkpoint's params
    kv_caches, hidden = jax.jit(model.forward, donate_argnums=1)(params, kv_caches, ids, md)
    logits = model.compute_logits(params, hidden[logits_indices])   # f32[R, V]

The object holds only static configuration (arch, dtype, attention); parameters and KV pages are
always passed in and returned, so the methods are safe to jit with the object bound.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxserve.models.arch_config import ModelArchConfig
from jaxserve.models.attention_metadata import AttentionMetadata
from jaxserve.models.decoder import Decoder
from jaxserve.models.layers import KVCache
from jaxserve.models.rope import rope_inv_freq, rope_tables
from jaxserve.pallas_kernels.ragged_paged_attention import AttentionImpl

REFERENCE = AttentionImpl("reference", "reference")

PARAM_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
TP_AXIS = "tp"

# Tensor-parallel layout, by the parameter's leaf name (Megatron style): projections into heads
# or MLP columns shard their output axis, the projections back to D shard their input axis, so
# each layer needs one all-reduce after o_proj and one after down_proj. KV heads are sharded
# too when tp divides K (the KV cache is sharded the same way, on its K axis); a group whose
# dimension tp does not divide is replicated (see param_partition_specs).
_TP_SPECS = {
    "q_proj": PartitionSpec(None, TP_AXIS, None),  # [D, N, H]  column-parallel over heads
    "k_proj": PartitionSpec(None, TP_AXIS, None),  # [D, K, H]
    "v_proj": PartitionSpec(None, TP_AXIS, None),  # [D, K, H]
    "q_bias": PartitionSpec(TP_AXIS, None),  # [N, H]
    "k_bias": PartitionSpec(TP_AXIS, None),  # [K, H]
    "v_bias": PartitionSpec(TP_AXIS, None),  # [K, H]
    "o_proj": PartitionSpec(TP_AXIS, None, None),  # [N, H, D]  row-parallel
    "gate_proj": PartitionSpec(None, TP_AXIS),  # [D, F]  column-parallel
    "up_proj": PartitionSpec(None, TP_AXIS),  # [D, F]
    "down_proj": PartitionSpec(TP_AXIS, None),  # [F, D]  row-parallel
    "embed": PartitionSpec(TP_AXIS, None),  # [V, D]  vocab-sharded
    "lm_head": PartitionSpec(TP_AXIS, None),  # [V, D]  vocab-sharded logits
}


class CausalLM:
    """A decoder-only LM of one ModelArchConfig, in one parameter dtype, with one attention
    implementation (an AttentionImpl, chosen by the execution plan).

    Params pytree (nested dicts of arrays in `dtype`):
        embed f[V, D]
        layers_{i} for i < L:
            input_norm {scale f[D]}, post_attn_norm {scale f[D]}
            attn {q_proj f[D, N, H], k_proj f[D, K, H], v_proj f[D, K, H], o_proj f[N, H, D],
                  [q_bias f[N, H], k_bias f[K, H], v_bias f[K, H]]  if arch.attention_bias
                  [o_bias f[D]]                                     if arch.attention_out_bias
                  [q_norm f[H], k_norm f[H]]                        if arch.qk_norm}
            mlp {gate_proj f[D, F], up_proj f[D, F], down_proj f[F, D]}
        final_norm {scale f[D]}
        lm_head f[V, D]   absent when arch.tie_word_embeddings (logits use embed)
    """

    def __init__(self, arch: ModelArchConfig, dtype: Any, attention: AttentionImpl) -> None:
        self.arch = arch
        self.dtype = jnp.dtype(dtype)
        if self.dtype not in [jnp.dtype(d) for d in PARAM_DTYPES]:
            raise ValueError(
                f"model dtype must be one of float32, bfloat16, float16, got {self.dtype}"
            )
        if not isinstance(attention, AttentionImpl):
            raise TypeError(f"attention must be an AttentionImpl, got {attention!r}")
        self.attention = attention
        self._module = Decoder(arch, self.dtype, attention)

    def __repr__(self) -> str:
        return (
            f"CausalLM({self.arch.architecture}, dtype={self.dtype.name}, "
            f"attention={self.attention.name!r})"
        )

    def rope_tables(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Host f32[length, H // 2] cos / sin tables for positions < length: a runner gathers a
        step's rows into AttentionMetadata.rope_cos / rope_sin (see rope.rope_tables)."""
        a = self.arch
        return rope_tables(rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling), length)

    def init_params(self, rng: jax.Array) -> dict[str, Any]:
        """Random params, deterministic in `rng`: matrices ~ normal(0, arch.initializer_range),
        norm scales 1, biases 0 (the modules' declared initializers).

        The normals come from one flat float32 stream sliced in the params' flattened order: one
        RNG kernel to compile instead of one per shape (threefry compiles take ~1 s each on
        CPU). The stream costs 4 bytes per parameter on top of the params while it lives.
        Traceable: under jax.eval_shape it allocates nothing.
        """
        return _init_fn(self.arch, self.dtype.name)(rng)

    def forward(
        self,
        params: dict[str, Any],
        kv_caches: list[KVCache],  # L x (k_pages, v_pages), each [K, S, P, H]
        input_ids: jax.Array,  # i32[T]
        md: AttentionMetadata,
    ) -> tuple[list[KVCache], jax.Array]:  # updated caches, f[T, D] (final-normed)
        """One step over the flattened ragged batch. Pure: jit it and donate kv_caches.

        Each token's K/V is written at md.slot_mapping before attention reads the pages, so a
        token attends to itself and to everything earlier in its sequence (within the sliding
        window, if any). Padding tokens must map to the null block 0.
        """
        return self._module.apply({"params": params}, input_ids, kv_caches, md)

    def compute_logits(
        self, params: dict[str, Any], hidden: jax.Array
    ) -> jax.Array:  # f[R, D] -> f32[R, V]
        """Logits of the rows that sample (float32 accumulation; tied embeddings handled)."""
        return self._module.apply({"params": params}, hidden, method=Decoder.logits)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """(K, S, P, H): shape of one layer's k_pages (and v_pages)."""
        return (self.arch.num_kv_heads, num_blocks, block_size, self.arch.head_dim)

    def kv_cache_bytes_per_block(self, block_size: int, dtype: Any) -> int:
        """Bytes one KV block takes across all layers, K and V together."""
        a = self.arch
        return (
            2 * a.num_layers * a.num_kv_heads * block_size * a.head_dim * jnp.dtype(dtype).itemsize
        )

    def param_shapes(self) -> dict[str, Any]:
        """The params pytree as jax.ShapeDtypeStruct leaves (allocates nothing)."""
        return _param_shapes(self.arch, self.dtype.name)

    def param_partition_specs(self, tp_size: int | None = None) -> dict[str, Any]:
        """PartitionSpecs matching the params pytree, for TP over a mesh axis named "tp".

        Column-parallel (output axis sharded): q/k/v_proj and their biases (heads), gate_proj,
        up_proj (F). Row-parallel (input axis sharded): o_proj (heads), down_proj (F).
        Vocab-sharded: embed (V axis) and lm_head (V axis). Replicated: norms and o_bias.

        Args:
            tp_size: the size of the "tp" mesh axis. None: the full layout, which requires
                tp | N, K, F, V. Given: a parameter whose sharded dimension tp does not divide is
                replicated instead; every parameter of a group shares that dimension (N: q, o;
                K: k, v; F: MLP; V: embed, lm_head), so a group is replicated as a whole. K < tp
                (GQA on many devices) replicates the KV projections; kv_cache_partition_spec
                replicates the pages to match.
        """

        def spec(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> PartitionSpec:
            name = path[-1].key
            if name not in _TP_SPECS:
                return PartitionSpec(*([None] * leaf.ndim))
            tp_spec = _TP_SPECS[name]
            if tp_size is not None and leaf.shape[tp_spec.index(TP_AXIS)] % tp_size:
                return PartitionSpec(*([None] * leaf.ndim))
            return tp_spec

        return jax.tree_util.tree_map_with_path(spec, self.param_shapes())

    def kv_cache_partition_spec(self, tp_size: int) -> PartitionSpec:
        """Spec of each layer's [K, S, P, H] pages: sharded on K when tp | K (each device holds
        the KV heads of its query heads), else replicated, like k_proj/v_proj then."""
        if self.arch.num_kv_heads % tp_size:
            return PartitionSpec(None, None, None, None)
        return PartitionSpec(TP_AXIS, None, None, None)

    def num_params(self) -> int:
        """Parameter count (from shapes only)."""
        leaves = jax.tree_util.tree_leaves(self.param_shapes())
        return int(sum(np.prod(leaf.shape) for leaf in leaves))


def _dummy_inputs(arch: ModelArchConfig, dtype: jnp.dtype) -> tuple[Any, ...]:
    """One token of one sequence in a one-page cache: enough to trace every parameter."""
    kv = [(jax.ShapeDtypeStruct((arch.num_kv_heads, 1, 1, arch.head_dim), dtype),) * 2]
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    md = AttentionMetadata(
        positions=i32(1),
        slot_mapping=i32(1),
        block_tables=i32(1, 1),
        seq_lens=i32(1),
        query_start_loc=i32(2),
        num_seqs=i32(1),
    )
    return i32(1), kv * arch.num_layers, md


@functools.lru_cache(maxsize=32)
def _param_shapes(arch: ModelArchConfig, dtype: str) -> dict[str, Any]:
    # Parameters do not depend on the attention implementation: trace with the pure-jnp one.
    module = Decoder(arch, jnp.dtype(dtype), REFERENCE)
    init = lambda rng, *inputs: module.init(rng, *inputs)["params"]
    return jax.eval_shape(init, jax.random.key(0), *_dummy_inputs(arch, jnp.dtype(dtype)))


_INIT_CHUNK = 1 << 20  # normals drawn per fixed-size chunk: one kernel, any model size
_ONES = ("scale", "q_norm", "k_norm")  # norm scales
_ZEROS = ("q_bias", "k_bias", "v_bias", "o_bias")
_NORMAL = (
    "embed",
    "lm_head",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


@functools.lru_cache(maxsize=32)
def _init_fn(arch: ModelArchConfig, dtype: str) -> Callable[[jax.Array], Any]:
    """A jitted rng -> params, cached per architecture so rebuilding a model recompiles nothing."""
    shapes = _param_shapes(arch, dtype)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    names = [path[-1].key for path, _ in paths_leaves]
    unknown = set(names) - set(_ONES + _ZEROS + _NORMAL)
    assert not unknown, f"no init policy for params {unknown}"
    sizes = [
        math.prod(leaf.shape) if name in _NORMAL else 0
        for name, (_, leaf) in zip(names, paths_leaves, strict=True)
    ]
    num_chunks = -(-sum(sizes) // _INIT_CHUNK)

    def init(rng: jax.Array) -> Any:
        chunk = lambda i: jax.random.normal(jax.random.fold_in(rng, i), (_INIT_CHUNK,))
        stream = jax.lax.map(chunk, jnp.arange(num_chunks))  # f32[chunks, _INIT_CHUNK]
        stream = stream.reshape(-1) * arch.initializer_range  # f32[chunks * _INIT_CHUNK]
        leaves, offset = [], 0
        for name, (_, leaf), size in zip(names, paths_leaves, sizes, strict=True):
            if name in _NORMAL:
                value = stream[offset : offset + size].reshape(leaf.shape)
            else:
                value = jnp.full(leaf.shape, 1.0 if name in _ONES else 0.0)
            leaves.append(value.astype(leaf.dtype))
            offset += size
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return jax.jit(init)


def get_model(
    arch: ModelArchConfig, *, dtype: Any = jnp.float32, attention: AttentionImpl = REFERENCE
) -> CausalLM:
    """The CausalLM of an architecture (every registered family shares one decoder).

    Args:
        attention: the implementation its layers call (the engine passes its execution plan's
            choice; the default is the pure-jnp reference, which runs anywhere).

    Raises:
        ValueError: dtype not float32/bfloat16/float16.
    """
    return CausalLM(arch, dtype, attention)
