"""AttentionMetadata: the per-step description of the flattened ragged batch, as a pytree.

Built on the host by the runner (numpy, padded to buckets), passed into the jitted step, read by
every attention layer. All fields are data (traced); shapes are fixed by the buckets, so a new
batch of the same buckets never recompiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array  # i32[T] position of each token in its sequence; padding: 0
    slot_mapping: jax.Array  # i32[T] flat KV slot (block_id * P + offset); padding: null block 0
    block_tables: jax.Array  # i32[R, B] physical block ids per sequence; padding: 0
    kv_lens: jax.Array  # i32[R] context length after this step (computed + scheduled); padding: 0
    cu_q_lens: jax.Array  # i32[R + 1] cumulative query rows; padding sequences repeat the end
    num_seqs: jax.Array  # i32[1] real sequences in the batch (R is the padded count)
    # f32[T, Q * H // 2] cos / sin of each token's RoPE angles (Q RoPE variants side by side,
    # see rope.model_inv_freq), looked up on the host in the model's rope_tables; None: the
    # step computes them from positions (same values).
    rope_cos: jax.Array | None = None
    rope_sin: jax.Array | None = None
    # f32[L, 2] (k_scale, v_scale) of each layer's FP8 KV pages (pallas_kernels/.../kv_quant.py):
    # constant for the engine's life, carried here so that every layer gets its pair as traced
    # data (a new value never recompiles); None: the pages are in the model dtype, unscaled.
    kv_scales: jax.Array | None = None
