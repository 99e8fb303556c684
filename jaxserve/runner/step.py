"""The pure engine step: the one jitted function of a step, the copy-on-write block copy, their
shardings, and the AttentionMetadata the step is given.

Nothing here holds state: ``jit_step`` and ``jit_copy`` return jitted functions that close over
the model (never the runner), and the runner (model_runner.py) calls them with its params, KV
pages and host arrays. The step's positional arguments are STEP_ARGS, in that order; a new
per-step input (a speculative-decoding draft) is one more of them, here: in STEP_ARGS,
``_step_fn`` and ``_step_shardings``; per-row sampling inputs (the structured-output token
mask) ride in SamplingMetadata instead, whose widths the sampler's variants fix.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.models import AttentionMetadata, CausalLM
from jaxserve.runner.input_batch import PreparedBatch
from jaxserve.runner.rejection_sampler import SampledDrafts, num_emitted_per_segment
from jaxserve.runner.sampler import logprobs_width, no_logprobs, prompt_logprobs, sample
from jaxserve.runner.sampling_metadata import SamplingMetadata
from jaxserve.runner.sharding import ShardingPlan
from jaxserve.runner.token_feed import TokenFeed

STEP_ARGS = (  # the step's positional arguments, named for compilation explanations
    "params",
    "kv_caches",
    "input_ids",
    "attention_metadata",
    "logits_indices",
    "draft_ids",
    "sampling_metadata",
    "prompt_targets",
    "token_feed",
    "draft_params",
    "draft_kv_caches",
    "draft_q",
)
COPY_ARGS = ("kv_caches", "src", "dst")


def jit_step(
    model: CausalLM,
    draw: str,
    sharding: ShardingPlan | None,
    draft: CausalLM | None = None,
    draft_sharding: ShardingPlan | None = None,
) -> Any:
    """The jitted step of ``model`` with the sampler's ``draw``: called with STEP_ARGS, it
    returns (kv_caches, sampler output, prompt logprobs, tokens emitted per logits segment,
    draft_kv_caches, last sampled token per slot: token_feed.py); the KV pages are donated.
    With a ``draft`` model (speculative decoding's "draft_model", placed by ``draft_sharding``
    on the same mesh), the step also runs the draft over the same batch, writing its KV pages
    (draft_model.py); without one, draft_params and draft_kv_caches are None."""
    draft_traces = None if draft is None else _SharedTraces(draft)
    draft_layers = 0 if draft is None else draft.arch.num_layers
    return jax.jit(
        functools.partial(_step_fn, _SharedTraces(model), draw, draft_traces),
        donate_argnames=("kv_caches", "draft_kv_caches"),
        **_step_shardings(sharding, model.arch.num_layers, draft_sharding, draft_layers),
    )


def jit_copy(sharding: ShardingPlan | None, num_layers: int) -> Any:
    """The jitted copy-on-write block copy: called with COPY_ARGS, it returns the KV pages
    (donated: updated in place)."""
    shardings = _copy_shardings(sharding, num_layers)
    return jax.jit(_copy_blocks, donate_argnames=("kv_caches",), **shardings)


def padded_copies(block_copies: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) of a step's block copies, padded to a power of two with null-block
    self-copies: few compiled shapes."""
    pairs = np.zeros((1 << (len(block_copies) - 1).bit_length(), 2), np.int32)
    pairs[: len(block_copies)] = block_copies
    return pairs[:, 0], pairs[:, 1]


class _SharedTraces:
    """The model's forward and logits as jax.jit(..., inline=True) functions, made once per
    runner: jax keeps each one's traced jaxpr by argument shapes, so the step's two sampler
    variants of a bucket (SamplingInputs.variant_widths), and the logits of the R rows and of
    every row when R == T, trace the model once instead of once each. Inlined: the step's HLO
    is what calling the model directly gives (no nested call, the same executables and cache
    keys)."""

    def __init__(self, model: CausalLM) -> None:
        self.arch = model.arch
        self.forward = jax.jit(model.forward, inline=True)
        self.compute_logits = jax.jit(model.compute_logits, inline=True)


def _step_fn(
    model: CausalLM | _SharedTraces,
    draw: str,
    draft: CausalLM | _SharedTraces | None,
    params: Any,
    kv_caches: list[tuple[jax.Array, jax.Array]],
    input_ids: jax.Array,  # i32[T]
    md: AttentionMetadata,
    logits_indices: jax.Array,  # i32[R] token row of each logits row (PreparedBatch)
    draft_ids: jax.Array,  # i32[R] draft each logits row verifies, -1: none (rejection_sampler)
    sampling_md: SamplingMetadata,
    prompt_targets: jax.Array,  # i32[T] next prompt token per row (prompt logprobs), else -1
    feed: TokenFeed,  # the samples of the step before, on device (async scheduling)
    draft_params: Any = None,  # the draft model's, with a draft; else None
    draft_kv_caches: Any = None,  # its KV pages (donated), with a draft; else None
    draft_q: Any = None,  # draft_model.DraftQ: its sampled drafts' q, with a draft; else None
):
    """The jitted step: forward, logits at the R sampling rows, sample, the speculative drafts'
    verification (how many tokens each segment of rows keeps; 1 per request without drafts),
    and the prompt logprobs of the rows that owe them (the [T, V] logits only when some row
    does: a run-time test). Placeholder input tokens are the step before's samples, read on
    device (token_feed.py); this step's samples are recorded for the next."""
    input_ids = feed.inputs(input_ids)
    kv_caches, hidden = model.forward(params, kv_caches, input_ids, md)  # [T, D]
    logits = model.compute_logits(params, hidden[logits_indices])  # f32[R, V]
    drafts = None
    if draft_q is not None:  # the rows that verify a sampled draft, and its q
        q_row = jnp.maximum(draft_q.q_rows, 0)
        drafts = SampledDrafts(
            draft_ids, draft_q.q_ids[q_row], draft_q.q_probs[q_row], draft_q.q_rows >= 0
        )
    pending = feed.pending_outputs(input_ids, logits_indices)
    out = sample(logits, sampling_md, draw=draw, drafts=drafts, pending_outputs=pending)
    num_emitted = num_emitted_per_segment(out.token_ids, draft_ids)  # i32[R]
    num = logprobs_width(model.arch.vocab_size)
    plp = lax.cond(
        jnp.any(prompt_targets >= 0),
        lambda: prompt_logprobs(model.compute_logits(params, hidden), prompt_targets, num=num),
        lambda: no_logprobs(prompt_targets.shape[0], num),
    )
    if draft is not None:  # the draft computes what the target did: its KV stays current
        draft_md = dataclasses.replace(md, rope_cos=None, rope_sin=None, kv_scales=None)
        draft_kv_caches, _ = draft.forward(draft_params, draft_kv_caches, input_ids, draft_md)
    return kv_caches, out, plp, num_emitted, draft_kv_caches, feed.record(out.token_ids)


def attention_metadata(
    batch: PreparedBatch,
    rope_tables: tuple[np.ndarray, np.ndarray] | None,
    kv_scales: np.ndarray | None = None,
) -> AttentionMetadata:
    """The step's AttentionMetadata; with host RoPE tables (the CPU plan), each token's cos /
    sin rows gathered from them (positions past them clip; real tokens stay below
    max_model_len), else none: the model computes them on device from the positions. An FP8
    KV cache's f32[L, 2] scales ride along (the same every step)."""
    rope = {}
    if rope_tables is not None:
        cos, sin = rope_tables
        rope = dict(
            rope_cos=np.take(cos, batch.positions, axis=0, mode="clip"),
            rope_sin=np.take(sin, batch.positions, axis=0, mode="clip"),
        )
    return AttentionMetadata(
        positions=batch.positions,
        slot_mapping=batch.slot_mapping,
        block_tables=batch.block_tables,
        kv_lens=batch.kv_lens,
        cu_q_lens=batch.cu_q_lens,
        num_seqs=batch.num_seqs,
        kv_scales=kv_scales,
        **rope,
    )


def _step_shardings(
    plan: ShardingPlan | None,
    num_layers: int,
    draft_plan: ShardingPlan | None = None,
    draft_layers: int = 0,
) -> dict[str, Any]:
    """jax.jit sharding arguments of the step: every argument and result explicit (params and
    pages as planned, the draft model's by its own plan, host inputs and sampled results
    replicated), so warm-up and serving hit the same executables. No plan: jit's defaults (one
    device)."""
    if plan is None:
        return {}
    kv, rep = plan.kv_shardings(num_layers), plan.replicated
    draft_params, draft_kv = rep, rep  # no draft: None arguments, any sharding
    if draft_plan is not None:
        draft_params, draft_kv = draft_plan.param_shardings(), draft_plan.kv_shardings(draft_layers)
    return dict(
        # params, kv_caches, input_ids, md, logits_indices, draft_ids, sampling_md,
        # prompt_targets, token_feed, draft_params, draft_kv_caches, draft_q
        in_shardings=(plan.param_shardings(), kv, *(rep,) * 7, draft_params, draft_kv, rep),
        # kv_caches, sampler output, prompt logprobs, tokens emitted per segment, draft KV,
        # last sampled tokens
        out_shardings=(kv, rep, rep, rep, draft_kv, rep),
    )


def _copy_shardings(plan: ShardingPlan | None, num_layers: int) -> dict[str, Any]:
    """jax.jit sharding arguments of the block copy: the pages as planned, the block ids
    replicated. No plan: jit's defaults (one device)."""
    if plan is None:
        return {}
    kv, rep = plan.kv_shardings(num_layers), plan.replicated
    return dict(in_shardings=(kv, rep, rep), out_shardings=kv)


def _copy_blocks(kv_caches, src: jax.Array, dst: jax.Array):
    """Copy-on-write: pages src[i] -> dst[i] in every layer (K and V). In place (donated)."""
    return [(k.at[:, dst].set(k[:, src]), v.at[:, dst].set(v[:, src])) for k, v in kv_caches]
