"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a float32 router sends every token to k of E
SwiGLU experts, and the T * k (token, expert) rows run as one grouped matmul per projection.

The grouped matmul: the T * k rows are sorted by expert, so each expert's rows are contiguous,
and group e of the rows is multiplied by expert e's weights (group sizes from a bincount); the
results are gathered back into (token, slot) order and summed with the routing weights. No
Python loop over experts, no dense all-experts product: shapes are static, always T * k rows,
and padding tokens are routed like any other (the runner discards their outputs).

Two implementations of the grouped SwiGLU compute the same thing (GROUPED_IMPLS):
  "ragged_dot"  three jax.lax.ragged_dot calls, XLA's grouped GEMM on GPU and TPU;
  "tiles"       a lax.scan over row tiles, each tile holding rows of one expert only (every
                group padded to whole tiles), each multiplied by its expert's weights; tiles
                past the used ones are skipped (lax.cond), so a step reads the weights of the
                experts its rows route to, once per tile (see tile_rows for the tile size).
jax lowers ragged_dot for the CPU generically: it masks the rows per group and contracts over
the expert axis too, so XLA:CPU multiplies every row by every expert's weights (E times the
work of the grouped product, every expert read for any batch). The MoE block therefore picks
"tiles" where the computation is lowered for the CPU and "ragged_dot" elsewhere, with
jax.lax.platform_dependent: a lowering-time choice, like jax's own lowerings of ragged_dot per
platform, with no platform probe in the traced code.

8-bit experts (quant.py, quantization "int8" / "fp8", weight-only): the stacks are int8 or
float8_e4m3fn with f32 per-expert, per-output-channel scales (experts_gate_scale /
experts_up_scale [E, F], experts_down_scale [E, D]). Each projection accumulates in float32,
multiplies row r of the result by the scale row of r's expert, and rounds once to the
activations' dtype, as quant.matmul does for a dense weight (x @ (q * s) == (x @ q) * s per
output channel; int8 and e4m3 values are exact in every model dtype). No full-precision copy of
the experts is kept:
  "tiles"       converts the one expert a tile multiplies inside that tile's matmul, tied to
                the tile's rows by quant._converted_after (XLA:CPU as measured keeps the
                convert of a dynamically sliced expert in the loop anyway; the tie guards
                against hoisting every layer's experts converted to the step's start). A step's
                temporaries are the float model's (tests/models/test_moe_quant.py checks
                compiled.memory_analysis()).
  "ragged_dot"  hands jax.lax.ragged_dot the 8-bit stack itself (it takes a narrower right
                operand and accumulates in float32), tied to the rows in its storage dtype
                (_tied_to: an 8-bit temporary at most). The compiler converts it where its
                grouped GEMM needs: jax's generic lowering (the one XLA:CPU runs) holds one
                projection's stack converted plus that lowering's own temporaries, about two
                f32 stacks, and as many for 4 layers as for 1 (measured; untied, every layer's
                stacks were converted up front). What XLA:GPU / TPU make of the mixed operands
                is not measured here.

Tensor parallelism shards the F axis of every expert (experts_gate / experts_up on their last
axis, experts_down on its F axis), as the dense MLP shards F: each device computes all T * k
rows over its slice of F and the down projection's partial sums meet in one all-reduce; routing
is replicated (the router is [D, E], small); 8-bit experts' scales shard with their output axis
(experts_gate_scale / experts_up_scale on F, experts_down_scale [E, D] replicated). Sharding E
instead would need the rows exchanged between devices before and after the experts (all-to-all)
and would leave devices idle whenever the routing is skewed; with F sharded the work per device
is even whatever the routing.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.models.arch_config import ModelArchConfig
from jaxserve.models.quant import _converted_after, linear_weight


def route(
    logits: jax.Array,  # f32[T, E]
    k: int,
    renormalize: bool,
) -> tuple[jax.Array, jax.Array]:  # f32[T, k] weights, i32[T, k] expert ids
    """Softmax over the E experts, then the k largest probabilities per token (ties to the lower
    expert id), divided by their sum when `renormalize` (Mixtral always; Qwen3-MoE with
    norm_topk_prob)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


GROUPED_IMPLS = ("ragged_dot", "tiles")
TILE_ROWS = 16  # the "tiles" implementation's tile multiple (but for small decodes, below)
SMALL_TILE_ROWS = 2  # up to this many rows per expert, a tile of exactly that many


def tile_rows(num_rows: int, num_experts: int) -> int:
    """Rows per tile for M = num_rows rows over E experts: M / E rounded up to a multiple of
    TILE_ROWS. Then there are at most ceil(M / tile) + E <= 2E + 1 tiles, so each expert's
    weights are read at most a few times per step, and the padded rows at most E * tile,
    about M: at most about twice the multiply work of M rows.

    A small decode (M / E <= SMALL_TILE_ROWS: 1 or 2 rows an expert, on average) gets tiles of
    M / E rows: each tile's matmuls are then matrix-vector products, bound by reading its
    expert, where a 16-row tile multiplied mostly padding; from 4 rows an expert smaller tiles
    read the experts more often and cost more (docs/benchmarks.md, "Design measurements").
    """
    per_expert = -(-num_rows // num_experts)
    if per_expert <= SMALL_TILE_ROWS:
        return per_expert
    return max(TILE_ROWS, -(-per_expert // TILE_ROWS) * TILE_ROWS)


# The 8-bit experts' f32 scales (experts_gate_scale [E, F], experts_up_scale [E, F],
# experts_down_scale [E, D]), or None for plain experts in the model dtype.
Scales = tuple[jax.Array, jax.Array, jax.Array] | None


def _tied_to(w: jax.Array, x: jax.Array) -> jax.Array:
    """The 8-bit stack `w` in its own dtype, computed only once x exists: the same trick as
    quant._converted_after (plus 0 derived from one bit of x's first element), without the
    convert, so what XLA may hoist is at most an 8-bit copy tied to this projection's rows."""
    bit = jax.lax.bitcast_convert_type(x.reshape(-1)[0].astype(jnp.float32), jnp.uint32) & 1
    # A float 0 (XLA folds an integer 0 * bit, and then the tie, but not a float one).
    zero = (0.0 * bit.astype(jnp.float32)).astype(w.dtype)
    return w + zero  # exactly w


def _ragged_project(
    x: jax.Array,  # [M, K] grouped by expert
    w: jax.Array,  # [E, K, N], in x.dtype or 8-bit
    group_sizes: jax.Array,  # i32[E]
    scale_rows: jax.Array | None,  # f32[M, N]: each row's expert's scale row; None: plain
) -> jax.Array:  # [M, N] in x.dtype
    if scale_rows is None:
        return jax.lax.ragged_dot(x, w, group_sizes)
    y = jax.lax.ragged_dot(x, _tied_to(w, x), group_sizes, preferred_element_type=jnp.float32)
    return (y * scale_rows).astype(x.dtype)


def _ragged_dot_swiglu(
    rows: jax.Array,  # [M, D] grouped by expert
    row_experts: jax.Array,  # i32[M]: each row's expert (sorted)
    group_sizes: jax.Array,  # i32[E], sum M
    gate: jax.Array,  # [E, D, F]
    up: jax.Array,  # [E, D, F]
    down: jax.Array,  # [E, F, D]
    scales: Scales = None,
) -> jax.Array:  # [M, D]
    row_scales = [None] * 3 if scales is None else [s[row_experts] for s in scales]
    h = jax.nn.silu(_ragged_project(rows, gate, group_sizes, row_scales[0]))  # [M, F]
    h = h * _ragged_project(rows, up, group_sizes, row_scales[1])
    return _ragged_project(h, down, group_sizes, row_scales[2])


def _tile_project(
    x: jax.Array,  # [tile, K], rows of one expert
    w: jax.Array,  # [K, N]: that expert's weight, in x.dtype or 8-bit
    scale: jax.Array | None,  # f32[N]: its scale row; None: plain
) -> jax.Array:  # [tile, N] in x.dtype
    if scale is None:
        return x @ w
    y = jnp.dot(x, _converted_after(w, x), preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)


def _tiled_swiglu(
    rows: jax.Array,  # [M, D] grouped by expert
    row_experts: jax.Array,  # i32[M]: each row's expert (sorted); unused (a tile has one)
    group_sizes: jax.Array,  # i32[E], sum M
    gate: jax.Array,  # [E, D, F]
    up: jax.Array,  # [E, D, F]
    down: jax.Array,  # [E, F, D]
    scales: Scales = None,
) -> jax.Array:  # [M, D]
    """The grouped SwiGLU as a scan over tiles of `tile` rows (tile_rows) of one expert each.

    Group e covers ceil(size_e / tile) tiles, numbered after the previous groups' (empty groups
    none), so at most ceil(M / tile) + min(E, M) tiles exist (a static bound: at most min(E, M)
    groups are not empty, each wasting less than one tile) and tile t starts at row
    start_e + (t - first_tile_e) * tile of its expert e. A group's last tile may reach into the
    next group's rows: only its own rows are written back. 8-bit experts: the tile's expert is
    converted inside its matmuls and scaled by its scale rows (all the tile's rows share them).
    """
    del row_experts
    num_rows, num_experts = rows.shape[0], group_sizes.shape[0]
    tile = tile_rows(num_rows, num_experts)
    tiles_of = (group_sizes + tile - 1) // tile  # i32[E]
    tile_end = jnp.cumsum(tiles_of)  # i32[E]: one past each group's last tile
    row_start = jnp.cumsum(group_sizes) - group_sizes  # i32[E]: each group's first row
    num_tiles = -(-num_rows // tile) + min(num_experts, num_rows)
    padded = jnp.concatenate([rows, jnp.zeros((tile, rows.shape[1]), rows.dtype)])  # [M + tile, D]

    def step(out: jax.Array, t: jax.Array) -> tuple[jax.Array, None]:  # out [M + tile, D]
        e = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), num_experts - 1)
        first = row_start[e] + (t - (tile_end[e] - tiles_of[e])) * tile
        mine = jnp.arange(tile) < row_start[e] + group_sizes[e] - first  # bool[tile]
        s_gate, s_up, s_down = (None,) * 3 if scales is None else (s[e] for s in scales)

        def compute(out: jax.Array) -> jax.Array:
            x = jax.lax.dynamic_slice_in_dim(padded, first, tile)  # [tile, D]
            h = jax.nn.silu(_tile_project(x, gate[e], s_gate)) * _tile_project(x, up[e], s_up)
            old = jax.lax.dynamic_slice_in_dim(out, first, tile)
            y = jnp.where(mine[:, None], _tile_project(h, down[e], s_down).astype(out.dtype), old)
            return jax.lax.dynamic_update_slice_in_dim(out, y, first, 0)

        return jax.lax.cond(t < tile_end[-1], compute, lambda out: out, out), None

    out = jnp.zeros((num_rows + tile, rows.shape[1]), rows.dtype)
    out, _ = jax.lax.scan(step, out, jnp.arange(num_tiles))
    return out[:num_rows]


def grouped_swiglu(
    x: jax.Array,  # [T, D]
    experts: jax.Array,  # i32[T, k]
    gate: jax.Array,  # [E, D, F]
    up: jax.Array,  # [E, D, F]
    down: jax.Array,  # [E, F, D]
    impl: str | None = None,
    scales: Scales = None,
) -> jax.Array:  # [T, k, D]: expert experts[t, j]'s output for token t
    """down_e(silu(x @ gate_e) * (x @ up_e)) for every (token, slot), grouped by expert.

    Args:
        gate, up, down: the expert stacks in x.dtype, or 8-bit (int8 / float8_e4m3fn) with
            `scales`.
        impl: one of GROUPED_IMPLS; None: "tiles" when lowered for the CPU, else "ragged_dot".
        scales: None (plain experts), or the f32 per-output-channel scales (gate [E, F],
            up [E, F], down [E, D]) of 8-bit stacks: each projection's f32 result is scaled
            per row by its expert's scales and rounded once to x.dtype.

    Raises:
        ValueError: an unknown impl; 8-bit stacks without scales or scales of the wrong shape.
    """
    if impl is not None and impl not in GROUPED_IMPLS:
        raise ValueError(f"impl must be one of {GROUPED_IMPLS} or None, got {impl!r}")
    _check_scales(gate, up, down, scales)
    num_tokens, k = experts.shape
    num_rows = num_tokens * k
    flat = experts.reshape(num_rows)  # row r: token r // k, slot r % k
    order = jnp.argsort(flat, stable=True)  # i32[T * k]: row order[i] is the i-th by expert
    group_sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)  # i32[E], sum T*k
    rows = jnp.take(x, order // k, axis=0)  # [T * k, D], grouped by expert
    args = (rows, flat[order], group_sizes, gate, up, down, scales)
    if impl is None:
        y = jax.lax.platform_dependent(*args, cpu=_tiled_swiglu, default=_ragged_dot_swiglu)
    else:
        y = (_tiled_swiglu if impl == "tiles" else _ragged_dot_swiglu)(*args)  # [T * k, D]
    # Back to (token, slot) order by a gather: position[r] is where row r landed in the sort.
    position = jnp.zeros(num_rows, jnp.int32).at[order].set(jnp.arange(num_rows, dtype=jnp.int32))
    return jnp.take(y, position, axis=0).reshape(num_tokens, k, -1)


def _check_scales(gate: jax.Array, up: jax.Array, down: jax.Array, scales: Scales) -> None:
    weights = {"gate": gate, "up": up, "down": down}
    if scales is None:
        narrow = [n for n, w in weights.items() if jnp.dtype(w.dtype).itemsize == 1]
        if narrow:
            raise ValueError(
                f"expert stack {narrow[0]!r} is {jnp.dtype(weights[narrow[0]].dtype).name}: "
                "8-bit experts need their scales (scales=None)"
            )
        return
    if not isinstance(scales, tuple | list) or len(scales) != 3:
        raise TypeError(f"scales must be None or (gate, up, down) scales, got {scales!r}")
    for (name, w), s in zip(weights.items(), scales, strict=True):
        want = (w.shape[0], w.shape[2])
        if tuple(s.shape) != want:
            raise ValueError(
                f"scale of expert stack {name!r} has shape {tuple(s.shape)}, expected {want} "
                f"(one per expert and output channel of its {tuple(w.shape)})"
            )


class MoE(nn.Module):
    """The routed SwiGLU mixture of a layer in arch.moe_layers.

    Params: router f[D, E] (the logits are accumulated and soft-maxed in float32),
    experts_gate / experts_up f[E, D, F], experts_down f[E, F, D] (F: moe_intermediate_size).
    With `quantization` the three stacks are 8-bit with f32 experts_gate_scale /
    experts_up_scale [E, F] and experts_down_scale [E, D] (quant.py); the router stays in
    `dtype`. The k expert outputs are combined in float32 and rounded once; transformers
    rounds each weighted output to the model dtype first (and Qwen3-MoE its routing weights),
    so in bfloat16 the two can differ in the last bits.
    """

    arch: ModelArchConfig
    dtype: jnp.dtype
    quantization: str | None = None  # quant.QUANTIZATIONS: the expert stacks, not the router

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        a = self.arch
        d, e, f = a.hidden_size, a.num_experts, a.moe_intermediate_size
        init = nn.initializers.normal(a.initializer_range)
        router = self.param("router", init, (d, e), self.dtype)
        logits = jnp.einsum("TD,DE->TE", x, router, preferred_element_type=jnp.float32)
        # For diagnostics only (a no-op unless "intermediates" is mutable in apply): tests read
        # the routing to tell a quantization's error from a near-tie routed differently.
        self.sow("intermediates", "router_logits", logits)
        weights, experts = route(logits, a.num_experts_per_tok, a.norm_topk_prob)  # [T, k] each
        shapes = {"experts_gate": (e, d, f), "experts_up": (e, d, f), "experts_down": (e, f, d)}
        stacks = {
            name: linear_weight(self, name, shape, init, self.dtype, self.quantization)
            for name, shape in shapes.items()
        }
        gate, up, down = (w for w, _ in stacks.values())
        scales = None if self.quantization is None else tuple(s for _, s in stacks.values())
        out = grouped_swiglu(x, experts, gate, up, down, scales=scales)  # [T, k, D]
        y = jnp.einsum("TkD,Tk->TD", out.astype(jnp.float32), weights)
        return y.astype(x.dtype)
