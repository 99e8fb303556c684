"""FP8 KV scales computed from the data: one calibration forward pass at start-up.

With a scale of 1.0 (vLLM's default when a checkpoint ships none) a checkpoint whose keys and
values are small stores most of them in e4m3's subnormal range (below 2^-6 the step is an
absolute 2^-9), so an entry of 0.01 keeps one or two significant bits. vLLM's
``calculate_kv_scales`` takes each layer's scales from the first prefill's K and V:
``k_scale = max|K| / 200``, ``v_scale = max|V| / 100`` (its K_SCALE_CONSTANT and
V_SCALE_CONSTANT), so the largest value seen lands at 200 (100) of e4m3's 448 and whatever
comes later has 2.2x (4.5x) of headroom before it saturates. This module applies the same
rule, with two differences:

1. The data is a fixed calibration prompt (CALIBRATION_TOKENS seeded token ids), run once
   when the engine is built, not the first user's prefill. So the scales, and every token the
   engine produces, never depend on which request happened to come first (a request's greedy
   and seeded tokens do not depend on what else the engine saw: docs/architecture.md section
   9), and a restarted engine gets the same scales.
2. Each scale is rounded up to a power of two. Dividing by a power of two is exact, so a value
   that was an FP8 normal at a scale of 1.0 is stored with exactly the rounding it had there
   (only its exponent moves): a computed scale can only turn subnormals into normals (and
   avoid saturation), never add error elsewhere. Unrounded scales, measured on the tiny
   checkpoints of tests/engine/test_fp8_kv_parity.py, moved the largest logprob error by up to
   2x either way (phi3 0.116 -> 0.216), from rounding noise alone. Rounding up keeps at least
   vLLM's headroom (the largest value lands between K_RANGE / 2 and K_RANGE). K and V are
taken after RoPE and any k_norm, as the pages hold them: the pass writes them into small pages
in the model dtype and reads the per-layer maxima back. It runs the pure-jnp reference
attention (any platform, any dtype, partitioned by GSPMD under tensor parallelism), compiled
once per engine (a few seconds for a tiny model).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import AttentionMetadata, CausalLM, get_model
from jaxserve.runner.kv_cache import allocate_kv_caches
from jaxserve.runner.sharding import ShardingPlan

logger = logging.getLogger("jaxserve")

CALIBRATION_TOKENS = 128  # tokens of the calibration prompt (fewer when max_model_len is)
CALIBRATION_SEED = 0  # its token ids: numpy's default_rng(CALIBRATION_SEED) over the vocabulary
# The value each layer's largest |K| and |V| is mapped to (vLLM's constants; e4m3's largest
# finite value is 448, e5m2's 57344).
K_RANGE = 200.0
V_RANGE = 100.0
_PAGE_SIZE = 16  # the calibration pages' block size (any: the reference reads any)


def scales_from_maxima(maxima: np.ndarray) -> np.ndarray:
    """f32[L, 2] (k_scale, v_scale) from f32[L, 2] (max|K|, max|V|) per layer: max / K_RANGE
    and max / V_RANGE, each rounded up to a power of two (module docstring); 1.0 where a
    maximum is 0 or not finite (nothing to fit)."""
    maxima = np.asarray(maxima, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.exp2(np.ceil(np.log2(maxima / np.array([K_RANGE, V_RANGE]))))
    usable = np.isfinite(scales) & (scales > 0)
    return np.where(usable, scales, 1.0).astype(np.float32)


def calculate_kv_scales(
    model: CausalLM, params: Any, sharding: ShardingPlan | None = None
) -> np.ndarray:
    """f32[L, 2] (k_scale, v_scale) per layer of ``model`` from one forward pass over the
    calibration prompt (module docstring).

    Args:
        model: the engine's model (its arch, dtype, max_model_len and quantization are used;
            its attention implementation is not: the pass uses the reference).
        params: its loaded parameters (placed by ``sharding`` when given).
        sharding: the engine's ShardingPlan under tensor parallelism, else None.
    """
    arch = model.arch
    limit = model.max_model_len or arch.max_position_embeddings
    num_tokens = min(CALIBRATION_TOKENS, limit)
    reference = get_model(
        arch,
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        quantization=model.quantization,
    )
    num_blocks = 1 + -(-num_tokens // _PAGE_SIZE)  # the null block 0, then the prompt's
    pages = allocate_kv_caches(
        arch.num_layers,
        reference.kv_cache_shape(num_blocks, _PAGE_SIZE),
        model.dtype,
        None if sharding is None else sharding.kv_sharding,
    )
    ids = np.random.default_rng(CALIBRATION_SEED).integers(0, arch.vocab_size, num_tokens)
    maxima = jax.jit(_kv_maxima, static_argnums=0)(
        reference, params, pages, ids.astype(np.int32), _one_sequence(num_tokens)
    )
    scales = scales_from_maxima(jax.device_get(maxima))
    logger.info(
        "FP8 KV scales from %d calibration tokens: k_scale %.4g..%.4g, v_scale %.4g..%.4g",
        num_tokens,
        scales[:, 0].min(),
        scales[:, 0].max(),
        scales[:, 1].min(),
        scales[:, 1].max(),
    )
    return scales


def _one_sequence(num_tokens: int) -> AttentionMetadata:
    """One prefill of num_tokens tokens in blocks 1, 2, ... (block 0 stays the null block)."""
    positions = np.arange(num_tokens, dtype=np.int32)
    num_blocks = -(-num_tokens // _PAGE_SIZE)
    return AttentionMetadata(
        positions=positions,
        slot_mapping=_PAGE_SIZE + positions,
        block_tables=np.arange(1, num_blocks + 1, dtype=np.int32)[None],
        kv_lens=np.array([num_tokens], np.int32),
        cu_q_lens=np.array([0, num_tokens], np.int32),
        num_seqs=np.array([1], np.int32),
    )


def _kv_maxima(model: CausalLM, params: Any, pages: Any, ids: jax.Array, md: AttentionMetadata):
    """f32[L, 2] max|K| and max|V| of each layer after the forward pass (the pages hold
    exactly the prompt's K and V; the rest are zeros)."""
    pages, _ = model.forward(params, pages, ids, md)
    return jnp.stack(
        [jnp.stack([jnp.max(jnp.abs(k.astype(jnp.float32))) for k in layer]) for layer in pages]
    )
