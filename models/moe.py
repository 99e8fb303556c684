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
                experts its rows route to, once per tile (see _tile_rows for the tile size).
jax lowers ragged_dot for the CPU generically: it masks the rows per group and contracts over
the expert axis too, so XLA:CPU multiplies every row by every expert's weights (E times the
work of the grouped product, every expert read for any batch). The MoE block therefore picks
"tiles" where the computation is lowered for the CPU and "ragged_dot" elsewhere, with
jax.lax.platform_dependent: a lowering-time choice, like jax's own lowerings of ragged_dot per
platform, with no platform probe in the traced code.

Tensor parallelism shards the F axis of every expert (experts_gate / experts_up on their last
axis, experts_down on its F axis), as the dense MLP shards F: each device computes all T * k
rows over its slice of F and the down projection's partial sums meet in one all-reduce;
routing is replicated (the router is [D, E], small). Sharding E instead would need the rows
exchanged between devices before and after the experts (all-to-all) and would leave devices
idle whenever the routing is skewed; with F sharded the work per device is even whatever the
routing.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.models.arch_config import ModelArchConfig


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
TILE_ROWS = 16  # the "tiles" implementation's smallest tile, and the multiple of every tile


def _tile_rows(num_rows: int, num_experts: int) -> int:
    """Rows per tile for M = num_rows rows over E experts: M / E rounded up to a multiple of
    TILE_ROWS. Then there are at most ceil(M / tile) + E <= 2E + 1 tiles, so each expert's
    weights are read at most a few times per step, and the padded rows at most E * tile,
    about M: at most about twice the multiply work of M rows (decode: a tile of TILE_ROWS)."""
    per_expert = -(-num_rows // num_experts)
    return max(TILE_ROWS, -(-per_expert // TILE_ROWS) * TILE_ROWS)


def _ragged_dot_swiglu(
    rows: jax.Array,  # [M, D] grouped by expert
    group_sizes: jax.Array,  # i32[E], sum M
    gate: jax.Array,  # [E, D, F]
    up: jax.Array,  # [E, D, F]
    down: jax.Array,  # [E, F, D]
) -> jax.Array:  # [M, D]
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, group_sizes))  # [M, F]
    h = h * jax.lax.ragged_dot(rows, up, group_sizes)
    return jax.lax.ragged_dot(h, down, group_sizes)


def _tiled_swiglu(
    rows: jax.Array,  # [M, D] grouped by expert
    group_sizes: jax.Array,  # i32[E], sum M
    gate: jax.Array,  # [E, D, F]
    up: jax.Array,  # [E, D, F]
    down: jax.Array,  # [E, F, D]
) -> jax.Array:  # [M, D]
    """The grouped SwiGLU as a scan over tiles of `tile` rows (_tile_rows) of one expert each.

    Group e covers ceil(size_e / tile) tiles, numbered after the previous groups' (empty groups
    none), so at most ceil(M / tile) + min(E, M) tiles exist (a static bound: at most min(E, M)
    groups are not empty, each wasting less than one tile) and tile t starts at row
    start_e + (t - first_tile_e) * tile of its expert e. A group's last tile may reach into the
    next group's rows: only its own rows are written back.
    """
    num_rows, num_experts = rows.shape[0], group_sizes.shape[0]
    tile = _tile_rows(num_rows, num_experts)
    tiles_of = (group_sizes + tile - 1) // tile  # i32[E]
    tile_end = jnp.cumsum(tiles_of)  # i32[E]: one past each group's last tile
    row_start = jnp.cumsum(group_sizes) - group_sizes  # i32[E]: each group's first row
    num_tiles = -(-num_rows // tile) + min(num_experts, num_rows)
    padded = jnp.concatenate([rows, jnp.zeros((tile, rows.shape[1]), rows.dtype)])  # [M + tile, D]

    def step(out: jax.Array, t: jax.Array) -> tuple[jax.Array, None]:  # out [M + tile, D]
        e = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), num_experts - 1)
        first = row_start[e] + (t - (tile_end[e] - tiles_of[e])) * tile
        mine = jnp.arange(tile) < row_start[e] + group_sizes[e] - first  # bool[tile]

        def compute(out: jax.Array) -> jax.Array:
            x = jax.lax.dynamic_slice_in_dim(padded, first, tile)  # [tile, D]
            h = jax.nn.silu(x @ gate[e]) * (x @ up[e])  # [tile, F]
            old = jax.lax.dynamic_slice_in_dim(out, first, tile)
            y = jnp.where(mine[:, None], (h @ down[e]).astype(out.dtype), old)
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
) -> jax.Array:  # [T, k, D]: expert experts[t, j]'s output for token t
    """down_e(silu(x @ gate_e) * (x @ up_e)) for every (token, slot), grouped by expert.

    Args:
        impl: one of GROUPED_IMPLS; None: "tiles" when lowered for the CPU, else "ragged_dot".
    """
    if impl is not None and impl not in GROUPED_IMPLS:
        raise ValueError(f"impl must be one of {GROUPED_IMPLS} or None, got {impl!r}")
    num_tokens, k = experts.shape
    num_rows = num_tokens * k
    flat = experts.reshape(num_rows)  # row r: token r // k, slot r % k
    order = jnp.argsort(flat, stable=True)  # i32[T * k]: row order[i] is the i-th by expert
    group_sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)  # i32[E], sum T*k
    rows = jnp.take(x, order // k, axis=0)  # [T * k, D], grouped by expert
    args = (rows, group_sizes, gate, up, down)
    if impl is None:
        y = jax.lax.platform_dependent(*args, cpu=_tiled_swiglu, default=_ragged_dot_swiglu)
    else:
        y = (_tiled_swiglu if impl == "tiles" else _ragged_dot_swiglu)(*args)  # [T * k, D]
    # Back to (token, slot) order by a gather: position[r] is where row r landed in the sort.
    position = jnp.zeros(num_rows, jnp.int32).at[order].set(jnp.arange(num_rows, dtype=jnp.int32))
    return jnp.take(y, position, axis=0).reshape(num_tokens, k, -1)


class MoE(nn.Module):
    """The routed SwiGLU mixture of a layer in arch.moe_layers.

    Params: router f[D, E] (the logits are accumulated and soft-maxed in float32),
    experts_gate / experts_up f[E, D, F], experts_down f[E, F, D] (F: moe_intermediate_size).
    The k expert outputs are combined in float32 and rounded once; transformers rounds each
    weighted output to the model dtype first (and Qwen3-MoE its routing weights), so in
    bfloat16 the two can differ in the last bits.
    """

    arch: ModelArchConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        a = self.arch
        d, e, f = a.hidden_size, a.num_experts, a.moe_intermediate_size
        init = nn.initializers.normal(a.initializer_range)
        router = self.param("router", init, (d, e), self.dtype)
        logits = jnp.einsum("TD,DE->TE", x, router, preferred_element_type=jnp.float32)
        weights, experts = route(logits, a.num_experts_per_tok, a.norm_topk_prob)  # [T, k] each
        out = grouped_swiglu(
            x,
            experts,
            self.param("experts_gate", init, (e, d, f), self.dtype),
            self.param("experts_up", init, (e, d, f), self.dtype),
            self.param("experts_down", init, (e, f, d), self.dtype),
        )  # [T, k, D]
        y = jnp.einsum("TkD,Tk->TD", out.astype(jnp.float32), weights)
        return y.astype(x.dtype)
