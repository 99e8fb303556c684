"""The sizes the memory plan (memory_plan.py) adds up, per device: the weights, the KV bytes
per token, an FP8 KV cache's scales and the step's workspace reserve. From shapes and configs
only: nothing here reads a weight or allocates.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxserve.models import TP_AXIS, CausalLM, ModelArchConfig
from jaxserve.runner.logprob_chunks import max_chunk_rows

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
# KV pages: the model dtypes, or an FP8 KV cache (config.FP8_STORAGE_DTYPES).
KV_DTYPE_SIZES = {**DTYPE_SIZES, "float8_e4m3fn": 1, "float8_e5m2": 1}

# The workspace reserve (workspace_bytes): the larger of the step's two halves (runner/step.py:
# two executables, run one after the other, so their buffers are never live at once).
# The forward half (forward_workspace_bytes), per token of a step, in the model dtype: 4
# hidden-sized buffers (residual stream, normed input, attention output, MLP output), q, k, v
# and the attention output (2 (N + K) H), and 3 MLP-sized ones (gate, up, their product). Per
# logits row, in f32: the logits it returns and a working copy of them (or, for a chunk of
# prompt logprobs, their log-softmax).
_HIDDEN_BUFFERS = 4
_MLP_BUFFERS = 3
_LOGITS_BUFFERS = 2
_LOGITS_ITEMSIZE = 4
# The sample half (sample_workspace_bytes): f32 [R, V] buffers per row of max_num_seqs, its
# logits argument and the sampler's temporaries. Measured with the real compilers, deviceless
# (memory_analysis of the sample half alone; docs/benchmarks.md, "Ahead-of-time compilation"),
# the temporaries in units of R x V x 4 bytes, without / with sampling lists (penalties, bans,
# token constraints: a variant every engine compiles):
#   XLA:TPU v6e-1, V = 128256:  R = 64: 2.1 / 10.1;  R = 128: 10.0 / 12.0;  R = 256: 10.0 / 15.1
#   XLA:TPU v5e-8 (tp 8), V = 128256, R = 256: 10.0 / 11.0 per chip
#   XLA:TPU v6e-1, V = 32000, R = 256: 3.1 / 7.2
#   XLA:GPU h200 and a100-80g, V = 128256:  R = 64 and R = 256: 3.1 / 6.1
# (top-k / top-p's sort keys and indices, the masked and penalised copies, layout copies). On
# XLA:GPU that is a fixed count; on XLA:TPU the compiler's schedule decides how many are live
# at once, hence no clean law there: the reserve takes the largest seen. Per platform: 1 (the
# logits) + the temporaries rounded up (TPU 16, GPU 7), which also covers the lists' own
# arguments (2 i32 [R, min(max_model_len + 1, V)]: 0.18 R V 4 at V = 128256 and max_model_len
# 8192); a platform not measured (the CPU, whose draw is a C++ kernel) takes the largest. Per
# device, not divided by tp: the sample half is replicated (runner/step.py: jit_sample), each
# device samples from the whole logits.
_SAMPLE_BUFFERS = {"tpu": 17, "gpu": 8}
_SAMPLE_BUFFERS_UNMEASURED = max(_SAMPLE_BUFFERS.values())


def weights_bytes(model: CausalLM, tensor_parallel_size: int) -> tuple[int, int]:
    """(bytes on one device, bytes of every parameter once) of `model`'s params, each in its
    own dtype (the model dtype, or 8-bit weights and f32 scales under a quantization),
    under the model's tensor-parallel layout for `tensor_parallel_size` devices (a sharded
    dimension counts 1/tp, a replicated parameter whole). From shapes only: allocates nothing.
    """
    shapes = jax.tree_util.tree_leaves(model.param_shapes())
    specs = jax.tree_util.tree_leaves(
        model.param_partition_specs(tensor_parallel_size),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    per_device = total = 0
    for leaf, spec in zip(shapes, specs, strict=True):
        size = int(np.prod(leaf.shape)) * leaf.dtype.itemsize
        total += size
        # param_partition_specs(tp) replicates any group tp does not divide: exact division.
        per_device += size // tensor_parallel_size if TP_AXIS in tuple(spec) else size
    return per_device, total


def kv_bytes_per_token(model: CausalLM, tensor_parallel_size: int, kv_cache_dtype: str) -> int:
    """KV cache bytes one token takes on one device: 2 x L x K x H x itemsize, / tp when the
    pages are sharded on K (tp | K; sharding.ShardingPlan.kv_bytes_per_block does the same)."""
    total = model.kv_cache_bytes_per_block(1, kv_cache_dtype)
    sharded = model.kv_cache_partition_spec(tensor_parallel_size)[0] == TP_AXIS
    return total // tensor_parallel_size if sharded else total


def kv_scales_bytes(arch: ModelArchConfig, kv_cache_dtype: str) -> int:
    """Bytes of an FP8 KV cache's scales: f32 (k_scale, v_scale) per layer, on every device
    (replicated); 0 for a KV cache in a model dtype, which has none."""
    return 0 if kv_cache_dtype in DTYPE_SIZES else 2 * 4 * arch.num_layers


def workspace_bytes(
    arch: ModelArchConfig,
    dtype: str,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    platform: str | None = None,
) -> int:
    """The reserve for one step's live buffers besides weights and KV pages, on one device:
    the larger of the forward half's (forward_workspace_bytes) and the sample half's
    (sample_workspace_bytes, on ``platform``). The step runs them as two executables, one
    after the other (runner/step.py), so the device holds one half's buffers at a time. It is
    a reserve, not a measurement (`jaxserve compile` measures it: docs/compilation.md).
    """
    forward = forward_workspace_bytes(
        arch, dtype, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs
    )
    sample = sample_workspace_bytes(arch, max_num_seqs=max_num_seqs, platform=platform)
    return max(forward, sample)


def forward_workspace_bytes(
    arch: ModelArchConfig, dtype: str, *, max_num_batched_tokens: int, max_num_seqs: int
) -> int:
    """The forward half's live buffers besides weights and KV pages, on one device:

        max_num_batched_tokens x (4 D + 2 (N + K) H + 3 F) x itemsize(dtype)     activations
      + max(max_num_seqs, C) x V x 4 bytes x 2                                  f32 logits

    (D hidden, N / K query / KV heads, H head_dim, F intermediate, V vocab; C the rows of one
    chunk of prompt logprobs, logprob_chunks.max_chunk_rows(max_num_batched_tokens): computed
    one chunk at a time, so the larger of the two sets of logits is live, never both.) Not
    divided by tp: XLA may keep more buffers alive than one layer's, so it errs on the
    generous side.
    """
    a = arch
    per_token = (
        _HIDDEN_BUFFERS * a.hidden_size
        + 2 * (a.num_heads + a.num_kv_heads) * a.head_dim
        + _MLP_BUFFERS * a.intermediate_size
    )
    activations = max_num_batched_tokens * per_token * DTYPE_SIZES[dtype]
    logits_rows = max(max_num_seqs, max_chunk_rows(max_num_batched_tokens))
    logits = logits_rows * a.vocab_size * _LOGITS_ITEMSIZE * _LOGITS_BUFFERS
    return activations + logits


def sample_workspace_bytes(
    arch: ModelArchConfig, *, max_num_seqs: int, platform: str | None = None
) -> int:
    """The sample half's live buffers on one device: max_num_seqs x V x 4 bytes x the
    platform's buffers (_SAMPLE_BUFFERS, measured, see there: 17 on TPU, 8 on GPU; 17 on a
    platform not measured or None), its f32 logits and the sampler's temporaries. Not divided
    by tp: the sample half runs replicated, on the whole logits, on every device."""
    buffers = _SAMPLE_BUFFERS.get(platform, _SAMPLE_BUFFERS_UNMEASURED)
    return max_num_seqs * arch.vocab_size * _LOGITS_ITEMSIZE * buffers
