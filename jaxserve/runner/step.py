"""The pure engine step as two jitted halves, forward then sample; the copy-on-write block
copy; their shardings; and the AttentionMetadata the forward is given.

    forward(FORWARD_ARGS)   per (T, R, B): forward, logits f32[R, V] at the R sampling rows,
                            prompt logprobs, the draft model's forward; KV pages donated
    sample(SAMPLE_ARGS)     per (R, sampler variant): sampler (token masks, penalties, bans),
                            rejection sampler, tokens emitted, the samples recorded per slot

The logits stay on the device between the two. Splitting them lets the host build the sample
half's inputs (the structured-output token masks, which need the step before's tokens) while
the forward half runs (EngineCore), and compiles the model once per bucket instead of once per
sampler variant.

Nothing here holds state: ``jit_forward``, ``jit_sample`` and ``jit_copy`` return jitted
functions that close over the model (never the runner), and the runner (model_runner.py) calls
them with its params, KV pages and host arrays. A new per-step input of the forward (a
speculative-decoding draft model's) is one more of FORWARD_ARGS, ``forward_fn`` and
``forward_shardings``; per-row sampling inputs (the structured-output token mask) ride in
SamplingMetadata instead, whose widths the sampler's variants fix.
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
from jaxserve.runner.logprob_chunks import chunked_prompt_logprobs
from jaxserve.runner.rejection_sampler import SampledDrafts, num_emitted_per_segment
from jaxserve.runner.sampler import logprobs_width, no_logprobs, sample
from jaxserve.runner.sampling_metadata import SamplingMetadata
from jaxserve.runner.sharding import ShardingPlan
from jaxserve.runner.token_feed import TokenFeed, record

FORWARD_ARGS = (  # the forward half's positional arguments, named for compile explanations
    "params",
    "kv_caches",
    "input_ids",
    "attention_metadata",
    "logits_indices",
    "prompt_targets",
    "token_feed",
    "draft_params",
    "draft_kv_caches",
)
SAMPLE_ARGS = (  # the sample half's
    "logits",
    "pending_outputs",
    "draft_ids",
    "sampling_metadata",
    "last_sampled",
    "sample_slot",
    "draft_q",
)
COPY_ARGS = ("kv_caches", "src", "dst")


def jit_forward(
    model: CausalLM,
    sharding: ShardingPlan | None,
    draft: CausalLM | None = None,
    draft_sharding: ShardingPlan | None = None,
) -> Any:
    """The jitted forward half of ``model``'s step: called with FORWARD_ARGS, it returns
    (kv_caches, logits f32[R, V], prompt logprobs, pending outputs i32[R], draft_kv_caches);
    the KV pages are donated. With a ``draft`` model (speculative decoding's "draft_model",
    placed by ``draft_sharding`` on the same mesh), it also runs the draft over the same batch,
    writing its KV pages (draft_model.py); without one, draft_params and draft_kv_caches are
    None."""
    draft_traces = None if draft is None else SharedTraces(draft)
    draft_layers = 0 if draft is None else draft.arch.num_layers
    return jax.jit(
        functools.partial(forward_fn, SharedTraces(model), draft_traces),
        donate_argnames=("kv_caches", "draft_kv_caches"),
        **forward_shardings(sharding, model.arch.num_layers, draft_sharding, draft_layers),
    )


def jit_sample(draw: str, sharding: ShardingPlan | None) -> Any:
    """The jitted sample half with the sampler's ``draw``: called with SAMPLE_ARGS, it returns
    (sampler output, tokens emitted per logits segment, last sampled token per slot:
    token_feed.py). Its shapes are R, V and the sampler variant's widths only: one executable
    serves every (T, B) of a row bucket."""
    rep = (
        {}
        if sharding is None
        else dict(
            in_shardings=(sharding.replicated,) * len(SAMPLE_ARGS),
            out_shardings=(sharding.replicated,) * 3,
        )
    )
    return jax.jit(functools.partial(sample_fn, draw), **rep)


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


class SharedTraces:
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


def forward_fn(
    model: CausalLM | SharedTraces,
    draft: CausalLM | SharedTraces | None,
    params: Any,
    kv_caches: list[tuple[jax.Array, jax.Array]],
    input_ids: jax.Array,  # i32[T]
    md: AttentionMetadata,
    logits_indices: jax.Array,  # i32[R] token row of each logits row (PreparedBatch)
    prompt_targets: jax.Array,  # i32[T] next prompt token per row (prompt logprobs), else -1
    feed: TokenFeed,  # the samples of the step before, on device (async scheduling)
    draft_params: Any = None,  # the draft model's, with a draft; else None
    draft_kv_caches: Any = None,  # its KV pages (donated), with a draft; else None
):
    """The forward half: forward, logits at the R sampling rows (left on device for the
    sample half), the prompt logprobs of the rows that owe them (the logits of every row, in
    chunks (logprob_chunks.py), only when some row does: a run-time test), and the draft
    model's forward. Placeholder input tokens are the step before's samples, read on device
    (token_feed.py); each logits row's placeholder input is handed to the sampler as its
    pending output (penalty counts)."""
    input_ids = feed.inputs(input_ids)
    kv_caches, hidden = model.forward(params, kv_caches, input_ids, md)  # [T, D]
    logits = model.compute_logits(params, hidden[logits_indices])  # f32[R, V]
    pending = feed.pending_outputs(input_ids, logits_indices)  # i32[R]
    num = logprobs_width(model.arch.vocab_size)
    plp = lax.cond(
        jnp.any(prompt_targets >= 0),
        lambda: chunked_prompt_logprobs(
            functools.partial(model.compute_logits, params), hidden, prompt_targets, num=num
        ),
        lambda: no_logprobs(prompt_targets.shape[0], num),
    )
    if draft is not None:  # the draft computes what the target did: its KV stays current
        draft_md = dataclasses.replace(md, rope_cos=None, rope_sin=None, kv_scales=None)
        draft_kv_caches, _ = draft.forward(draft_params, draft_kv_caches, input_ids, draft_md)
    return kv_caches, logits, plp, pending, draft_kv_caches


def sample_fn(
    draw: str,
    logits: jax.Array,  # f32[R, V] the forward half's
    pending: jax.Array,  # i32[R] the forward half's pending outputs
    draft_ids: jax.Array,  # i32[R] draft each logits row verifies, -1: none (rejection_sampler)
    sampling_md: SamplingMetadata,
    last_sampled: jax.Array,  # i32[S] last sampled token per slot (token_feed.py)
    sample_slot: jax.Array,  # i32[R] slot each logits row's sample is recorded in
    draft_q: Any = None,  # draft_model.DraftQ: its sampled drafts' q, with a draft; else None
):
    """The sample half: sample (token masks included), the speculative drafts' verification
    (how many tokens each segment of rows keeps; 1 per request without drafts), and this
    step's samples recorded per slot for the next step's placeholders."""
    drafts = None
    if draft_q is not None:  # the rows that verify a sampled draft, and its q
        q_row = jnp.maximum(draft_q.q_rows, 0)
        drafts = SampledDrafts(
            draft_ids, draft_q.q_ids[q_row], draft_q.q_probs[q_row], draft_q.q_rows >= 0
        )
    out = sample(logits, sampling_md, draw=draw, drafts=drafts, pending_outputs=pending)
    num_emitted = num_emitted_per_segment(out.token_ids, draft_ids)  # i32[R]
    return out, num_emitted, record(last_sampled, sample_slot, out.token_ids)


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


def forward_shardings(
    plan: ShardingPlan | None,
    num_layers: int,
    draft_plan: ShardingPlan | None = None,
    draft_layers: int = 0,
) -> dict[str, Any]:
    """jax.jit sharding arguments of the forward half: every argument and result explicit
    (params and pages as planned, the draft model's by its own plan, host inputs, logits and
    prompt logprobs replicated), so warm-up and serving hit the same executables. No plan:
    jit's defaults (one device)."""
    if plan is None:
        return {}
    kv, rep = plan.kv_shardings(num_layers), plan.replicated
    draft_params, draft_kv = rep, rep  # no draft: None arguments, any sharding
    if draft_plan is not None:
        draft_params, draft_kv = draft_plan.param_shardings(), draft_plan.kv_shardings(draft_layers)
    return dict(
        # params, kv_caches, input_ids, md, logits_indices, prompt_targets, token_feed,
        # draft_params, draft_kv_caches
        in_shardings=(plan.param_shardings(), kv, *(rep,) * 5, draft_params, draft_kv),
        # kv_caches, logits, prompt logprobs, pending outputs, draft KV
        out_shardings=(kv, rep, rep, rep, draft_kv),
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
