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
from jaxserve.models.quant import INPUT_AXES, SCALE_SUFFIX, check_quantizable, quantize
from jaxserve.models.rope import model_inv_freq, rope_tables
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
    # 8-bit weights' f32 scales (quant.py) shard with their output axis: q/k/v over heads,
    # gate/up over F; o_proj_scale and down_proj_scale [D] are replicated, as o_bias.
    "q_proj_scale": PartitionSpec(TP_AXIS, None),  # [N, H]
    "k_proj_scale": PartitionSpec(TP_AXIS, None),  # [K, H]
    "v_proj_scale": PartitionSpec(TP_AXIS, None),  # [K, H]
    "gate_proj_scale": PartitionSpec(TP_AXIS),  # [F]
    "up_proj_scale": PartitionSpec(TP_AXIS),  # [F]
    # MoE (models/moe.py): every expert's F axis, as the dense MLP; the router is replicated.
    "experts_gate": PartitionSpec(None, None, TP_AXIS),  # [E, D, F]  column-parallel
    "experts_up": PartitionSpec(None, None, TP_AXIS),  # [E, D, F]
    "experts_down": PartitionSpec(None, TP_AXIS, None),  # [E, F, D]  row-parallel
    # 8-bit experts' scales, with their output axis: gate/up over F; experts_down_scale [E, D]
    # is replicated (not listed).
    "experts_gate_scale": PartitionSpec(None, TP_AXIS),  # [E, F]
    "experts_up_scale": PartitionSpec(None, TP_AXIS),  # [E, F]
    "embed": PartitionSpec(TP_AXIS, None),  # [V, D]  vocab-sharded
    "lm_head": PartitionSpec(TP_AXIS, None),  # [V, D]  vocab-sharded logits
}


class CausalLM:
    """A decoder-only LM of one ModelArchConfig, in one parameter dtype, with one attention
    implementation (an AttentionImpl, chosen by the execution plan).

    Params pytree (nested dicts of arrays in `dtype`):
        embed f[V, D]
        layers_{i} for i < L:
            input_norm {scale f[D]}, post_attn_norm {scale f[D]} (before the MLP)
            [attn_out_norm {scale f[D]}, mlp_out_norm {scale f[D]}]  if arch.sandwich_norms
            attn {q_proj f[D, N, H], k_proj f[D, K, H], v_proj f[D, K, H], o_proj f[N, H, D],
                  [q_bias f[N, H], k_bias f[K, H], v_bias f[K, H]]  if arch.attention_bias
                  [o_bias f[D]]                                     if arch.attention_out_bias
                  [q_norm f[H], k_norm f[H]]                        if arch.qk_norm}
            mlp {gate_proj f[D, F], up_proj f[D, F], down_proj f[F, D]}  dense layers, or
            moe {router f[D, E], experts_gate f[E, D, F], experts_up f[E, D, F],
                 experts_down f[E, F, D]}  in arch.moe_layers (F = moe_intermediate_size)
        final_norm {scale f[D]}
        lm_head f[V, D]   absent when arch.tie_word_embeddings (logits use embed)

    With `quantization` ("int8" / "fp8", quant.py) each layer's q/k/v/o_proj, gate/up/down_proj
    and MoE expert stacks are 8-bit (int8 / float8_e4m3fn) with a sibling f32 `{name}_scale` of
    their output axes (q_proj_scale [N, H], o_proj_scale [D], gate/up_proj_scale [F],
    down_proj_scale [D], experts_gate/up_scale [E, F], experts_down_scale [E, D]); embed,
    lm_head, norms, biases and MoE routers stay in `dtype`.
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: Any,
        attention: AttentionImpl,
        max_model_len: int | None = None,
        quantization: str | None = None,
    ) -> None:
        self.arch = arch
        self.dtype = jnp.dtype(dtype)
        if self.dtype not in [jnp.dtype(d) for d in PARAM_DTYPES]:
            raise ValueError(
                f"model dtype must be one of float32, bfloat16, float16, got {self.dtype}"
            )
        if not isinstance(attention, AttentionImpl):
            raise TypeError(f"attention must be an AttentionImpl, got {attention!r}")
        self.attention = attention
        check_quantizable(arch, quantization)
        self.quantization = quantization
        # The longest sequence served (None: max_position_embeddings): LongRoPE's factor set
        # depends on it (rope._longrope_factors); nothing else does.
        self.max_model_len = max_model_len
        self._module = Decoder(arch, self.dtype, attention, max_model_len, quantization)

    def __repr__(self) -> str:
        return (
            f"CausalLM({self.arch.architecture}, dtype={self.dtype.name}, "
            f"attention={self.attention.name!r}, quantization={self.quantization!r})"
        )

    def rope_tables(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Host f32[length, Q * H // 2] cos / sin tables for positions < length (every RoPE
        variant side by side): a runner gathers a step's rows into AttentionMetadata.rope_cos /
        rope_sin (see rope.rope_tables)."""
        return rope_tables(model_inv_freq(self.arch, self.max_model_len), length)

    def init_params(self, rng: jax.Array) -> dict[str, Any]:
        """Random params, deterministic in `rng`: matrices ~ normal(0, arch.initializer_range),
        norm scales 1 (0 with arch.norm_unit_offset, which scales by 1 + w), biases 0 (the
        modules' declared initializers).

        The normals come from one flat float32 stream sliced in the params' flattened order: one
        RNG kernel to compile instead of one per shape (threefry compiles take ~1 s each on
        CPU). The stream costs 4 bytes per parameter on top of the params while it lives.
        Traceable: under jax.eval_shape it allocates nothing. With a quantization the linear
        weights are drawn in `dtype` and quantized (quant.quantize), as a checkpoint would be.
        """
        return _init_fn(self.arch, self.dtype.name, self.quantization)(rng)

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
        return _param_shapes(self.arch, self.dtype.name, self.quantization)

    def param_partition_specs(self, tp_size: int | None = None) -> dict[str, Any]:
        """PartitionSpecs matching the params pytree, for TP over a mesh axis named "tp".

        Column-parallel (output axis sharded): q/k/v_proj and their biases (heads), gate_proj,
        up_proj, experts_gate, experts_up (F). Row-parallel (input axis sharded): o_proj
        (heads), down_proj, experts_down (F). Vocab-sharded: embed (V axis) and lm_head (V
        axis). Replicated: norms, o_bias and the MoE router. 8-bit weights' scales shard with
        their output axis (q/k/v over heads, gate/up and the experts' gate/up over F) and are
        replicated where that axis is D (o_proj, down_proj, experts_down).

        Args:
            tp_size: the size of the "tp" mesh axis. None: the full layout, which requires
                tp | N, K, F, V. Given: a parameter whose sharded dimension tp does not divide is
                replicated instead; every parameter of a group shares that dimension (N: q, o;
                K: k, v; F: MLP; the experts' F: MoE; V: embed, lm_head), so a group is
                replicated as a whole. K < tp (GQA on many devices) replicates the KV
                projections; kv_cache_partition_spec replicates the pages to match.
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
        kv_lens=i32(1),
        cu_q_lens=i32(2),
        num_seqs=i32(1),
    )
    return i32(1), kv * arch.num_layers, md


@functools.lru_cache(maxsize=32)
def _param_shapes(arch: ModelArchConfig, dtype: str, quantization: str | None) -> dict[str, Any]:
    # Parameters do not depend on the attention implementation: trace with the pure-jnp one.
    module = Decoder(arch, jnp.dtype(dtype), REFERENCE, quantization=quantization)
    init = lambda rng, *inputs: module.init(rng, *inputs)["params"]
    return jax.eval_shape(init, jax.random.key(0), *_dummy_inputs(arch, jnp.dtype(dtype)))


_INIT_CHUNK = 1 << 20  # normals drawn per fixed-size chunk: one kernel, any model size
_ONES = ("scale", "q_norm", "k_norm")  # norm scales: 1, or 0 with arch.norm_unit_offset
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
    "router",
    "experts_gate",
    "experts_up",
    "experts_down",
)


@functools.lru_cache(maxsize=32)
def _init_fn(
    arch: ModelArchConfig, dtype: str, quantization: str | None
) -> Callable[[jax.Array], Any]:
    """A jitted rng -> params, cached per architecture so rebuilding a model recompiles nothing.

    With a quantization: the float params of the same rng, each linear weight quantized in the
    same jit (so init_params(rng) quantized is quant.quantize of init_params(rng) unquantized).
    """
    if quantization is not None:
        float_init = _init_fn(arch, dtype, None)
        return jax.jit(lambda rng: _quantize_tree(float_init(rng), quantization))
    shapes = _param_shapes(arch, dtype, None)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    names = [path[-1].key for path, _ in paths_leaves]
    unknown = set(names) - set(_ONES + _ZEROS + _NORMAL)
    assert not unknown, f"no init policy for params {unknown}"
    sizes = [
        math.prod(leaf.shape) if name in _NORMAL else 0
        for name, (_, leaf) in zip(names, paths_leaves, strict=True)
    ]
    num_chunks = -(-sum(sizes) // _INIT_CHUNK)
    one = 0.0 if arch.norm_unit_offset else 1.0  # the norms' neutral scale

    def init(rng: jax.Array) -> Any:
        chunk = lambda i: jax.random.normal(jax.random.fold_in(rng, i), (_INIT_CHUNK,))
        stream = jax.lax.map(chunk, jnp.arange(num_chunks))  # f32[chunks, _INIT_CHUNK]
        stream = stream.reshape(-1) * arch.initializer_range  # f32[chunks * _INIT_CHUNK]
        leaves, offset = [], 0
        for name, (_, leaf), size in zip(names, paths_leaves, sizes, strict=True):
            if name in _NORMAL:
                value = stream[offset : offset + size].reshape(leaf.shape)
            else:
                value = jnp.full(leaf.shape, one if name in _ONES else 0.0)
            leaves.append(value.astype(leaf.dtype))
            offset += size
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return jax.jit(init)


def _quantize_tree(tree: dict[str, Any], quantization: str) -> dict[str, Any]:
    """Every linear weight of a float params tree (quant.INPUT_AXES names) as 8-bit + scale."""
    out: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            out[name] = _quantize_tree(value, quantization)
        elif name in INPUT_AXES:
            out[name], out[name + SCALE_SUFFIX] = quantize(value, INPUT_AXES[name], quantization)
        else:
            out[name] = value
    return out


def get_model(
    arch: ModelArchConfig,
    *,
    dtype: Any = jnp.float32,
    attention: AttentionImpl = REFERENCE,
    max_model_len: int | None = None,
    quantization: str | None = None,
) -> CausalLM:
    """The CausalLM of an architecture (every registered family shares one decoder).

    Args:
        attention: the implementation its layers call (the engine passes its execution plan's
            choice; the default is the pure-jnp reference, which runs anywhere).
        max_model_len: the longest sequence the engine serves (None: max_position_embeddings);
            it only picks LongRoPE's short or long factors (Phi-3, see rope.py).
        quantization: None, or "int8" / "fp8": 8-bit linear weights and MoE experts (see
            CausalLM).

    Raises:
        ValueError: dtype not float32/bfloat16/float16, or an unknown quantization.
    """
    return CausalLM(arch, dtype, attention, max_model_len, quantization)
