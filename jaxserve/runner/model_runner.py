"""ModelRunner: SchedulerOutput in, sampled tokens out; one jitted step per engine step.

    execute_model(scheduler_output)
        InputBatch.update(...)         persistent numpy rows, updated incrementally
        InputBatch.prepare(...)        padded host arrays for buckets (T, R, B)
        SamplingInputs.build(...)      per-row sampling settings
        step(params, kv_caches, ...)   ONE jit: forward, logits at R rows, sample; KV donated
        -> ModelRunnerOutput           only the sampled ids (and logprobs) come back

Compiled variants are keyed by the bucket shapes and the sampler's two list widths (none, or
penalty and ban lists); warm-up can compile every (T, R, B) in both, and the copy-on-write block
copy at every padded size; `num_compilations` counts fresh compilations, and every one after
warm-up is explained (step_compiles.py).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.models import AttentionMetadata, CausalLM
from jaxserve.outputs import ModelRunnerOutput
from jaxserve.runner.buckets import BucketSpec
from jaxserve.runner.input_batch import InputBatch, PreparedBatch
from jaxserve.runner.kv_cache import allocate_kv_caches
from jaxserve.runner.kv_offload import KVOffloader
from jaxserve.runner.map_budget import max_step_shapes
from jaxserve.runner.plan import ExecutionPlan
from jaxserve.runner.sampler import (
    logprobs_width,
    no_logprobs,
    prompt_logprobs,
    sample,
    to_token_logprobs,
)
from jaxserve.runner.sampling_metadata import SamplingInputs, SamplingMetadata
from jaxserve.runner.sharding import ShardingPlan
from jaxserve.runner.step_compiles import (
    Compilation,
    StepCompiles,
    compile_concurrently,
)
from jaxserve.runner.step_trace import StepTrace


class ModelRunner:
    """Owns the device state (params, KV pages) and the host mirrors of the batch.

    Args:
        model: the CausalLM (static config; params passed separately).
        params: its parameters, already on device.
        num_kv_blocks: pages in the pool, null block 0 included.
        block_size, max_num_seqs, max_num_batched_tokens, max_model_len: as the engine config.
        eos_token_ids: for min_tokens bans.
        sharding: where params, KV pages and step inputs live (tensor parallelism; the
            params must already be placed by it), or None: the default device.
        plan: the execution plan (buckets, RoPE rows on the host or not, the sampler's draw,
            the KV pages' dtype).
        kv_scales: host f32[L, 2] (k_scale, v_scale) per layer of an FP8 KV cache
            (runner/kv_scales.py), sent with every step's AttentionMetadata; None otherwise.
    """

    def __init__(
        self,
        model: CausalLM,
        params: Any,
        *,
        num_kv_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        sharding: ShardingPlan | None = None,
        plan: ExecutionPlan,
        kv_scales: np.ndarray | None = None,
    ) -> None:
        self.model = model
        self.kv_scales = kv_scales
        self.params = params
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.vocab_size = model.arch.vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.sharding = sharding
        self.plan = plan
        # Host f32[max_model_len, H // 2] cos / sin tables, when the plan gathers the step's
        # RoPE rows on the host (the CPU); elsewhere the model computes them on device.
        self.rope_tables = model.rope_tables(max_model_len) if plan.host_rope else None
        self._init_host_state()
        # Copies per step are padded to a power of two (null-block self-copies); a step copies
        # at most one block per request, so these are every size warm-up must compile.
        self.copy_sizes = tuple(1 << k for k in range((max_num_seqs - 1).bit_length() + 1))
        self.buckets = BucketSpec.create(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=self.input_batch.max_blocks_per_seq,
            # An implementation whose cost stops at the batch's longest context gets
            # full-width tables: one compiled shape per token bucket, no width buckets.
            bucket_width=not model.attention.length_bounded,
            mid_token_buckets=plan.mid_token_buckets,
            single_token_bucket=plan.single_token_bucket,
            max_shapes=max_step_shapes(
                plan.max_executables, len(self.sampling.variant_widths), len(self.copy_sizes)
            ),
        )
        self.kv_caches = self._allocate_kv_caches()
        # The jitted functions hold the model, never the runner: nothing of the runner is in a
        # reference cycle, so dropping the last LLM frees its device memory at once, without
        # waiting for the cyclic garbage collector.
        self.compiles = compiles = StepCompiles("the engine step")
        step_shardings, copy_shardings = _jit_shardings(sharding, model.arch.num_layers)
        self._jitted_step = jitted = jax.jit(
            functools.partial(_step_fn, _SharedTraces(model), plan.sampler_draw),
            donate_argnames=("kv_caches",),
            **step_shardings,
        )
        self._step = lambda *args: compiles(jitted, args, STEP_ARGS)
        self.copy_compiles = copies = StepCompiles("the copy-on-write block copy")
        self._jitted_copy = jitted_copy = jax.jit(
            _copy_blocks, donate_argnames=("kv_caches",), **copy_shardings
        )
        self._copy = lambda *args: copies(jitted_copy, args, COPY_ARGS)
        # The StepTrace the current step fills in, while the engine traces steps (None: off).
        self.trace: StepTrace | None = None
        # The host KV tier's data side, set by the factory when kv_offloading_size > 0.
        self.kv_offload: KVOffloader | None = None

    def _init_host_state(self) -> None:
        """Empty host mirrors: batch rows, sampling settings, logprob bookkeeping."""
        self.input_batch = InputBatch(self.max_num_seqs, self.max_model_len, self.block_size)
        self.sampling = SamplingInputs(
            self.max_num_seqs, self.vocab_size, self.max_model_len, eos_token_ids=self.eos_token_ids
        )
        # req_id -> prompt-logprobs progress; kept across preemption, dropped when finished.
        self._prompt_logprobs: dict[str, _PromptLogprobsState] = {}
        self._num_logprobs: dict[str, int] = {}  # req_id -> top-N logprobs asked

    def _allocate_kv_caches(self) -> list[tuple[jax.Array, jax.Array]]:
        model = self.model
        return allocate_kv_caches(
            model.arch.num_layers,
            model.kv_cache_shape(self.num_kv_blocks, self.block_size),
            self.plan.kv_cache_dtype,
            None if self.sharding is None else self.sharding.kv_sharding,
        )

    @property
    def is_idle(self) -> bool:
        """True when the runner holds no request: no batch row, no logprob bookkeeping."""
        return not len(self.input_batch) and not self._prompt_logprobs and not self._num_logprobs

    @property
    def num_compilations(self) -> int:
        """XLA compilations of the step and the block copy so far (not those loaded from the
        persistent compilation cache: num_compilation_cache_hits)."""
        return sum(c.num_fresh for c in self._all_compiles())

    @property
    def num_compilation_cache_hits(self) -> int:
        return sum(c.num_cache_hits for c in self._all_compiles())

    @property
    def recompilations(self) -> list[dict[str, Any]]:
        """Every compilation after warm-up, with what was new (step_compiles.py)."""
        return [event for c in self._all_compiles() for event in c.events]

    def _all_compiles(self) -> list[StepCompiles]:
        offload = [self.kv_offload.compiles] if self.kv_offload is not None else []
        return [self.compiles, self.copy_compiles, *offload]

    def reset(self) -> bool:
        """Forget every request: the recovery of an engine step that raised part-way.

        The host buffers are rebuilt empty. The KV pages survive unless the failed step left
        them unusable (donated to a jitted call whose result was never stored, or poisoned by
        a failed computation); then they are reallocated, zeroed.

        Returns:
            True when the KV pages were reallocated: every cached prefix is gone, and the
            scheduler must drop its prefix cache.
        """
        self._init_host_state()
        if _all_ready(self.kv_caches):
            return False
        self.kv_caches = None  # release the dead buffers before allocating new ones
        self.kv_caches = self._allocate_kv_caches()
        return True

    # ---- compilation ------------------------------------------------------------------------
    def warmup(self, shapes: list[tuple[int, int, int]] | None = None, workers: int = 1) -> int:
        """Compile the step for every (T, R, B) bucket (default: all of them) in both of its
        variants (a batch without penalties or bans, and one with them at the one width every
        accepted request fits: SamplingInputs.variant_widths), and the copy-on-write block copy
        (n > 1) for every size of copy_sizes. Every other sampling feature (greedy or sampled
        rows, seeds, logprobs, prompt logprobs, min_tokens) runs in these same compiled steps.

        Each is lowered and compiled ahead of time, ``workers`` at a time (threads: XLA
        compiles without the GIL), for the arguments of an all-padding batch. jax keeps the
        executables, and the engine's calls with the same shapes run them without tracing
        again (tests/runner/test_warmup.py). Then each runs once (_run_once).

        Returns the number of compilations this caused (fresh or loaded from the cache);
        compilations after it are explained in the log (step_compiles.py).
        """
        before = self.num_compilations + self.num_compilation_cache_hits
        shapes = shapes or self.buckets.all_shapes()
        jobs = [
            Compilation(
                self.compiles,
                self._jitted_step,
                (self.params, self.kv_caches, *self._padding_step_inputs(t, r, b, widths)),
                STEP_ARGS,
            )
            for t, r, b in shapes
            for widths in self.sampling.variant_widths
        ]
        jobs += [
            Compilation(
                self.copy_compiles,
                self._jitted_copy,
                (self.kv_caches, *(np.zeros(n, np.int32),) * 2),
                COPY_ARGS,
            )
            for n in self.copy_sizes
        ]
        if self.kv_offload is not None:
            jobs += self.kv_offload.compilations(self.kv_caches)
        compile_concurrently(jobs, workers)
        for compiles in self._all_compiles():
            compiles.warmed_up = True
        self._run_once(shapes)
        return self.num_compilations + self.num_compilation_cache_hits - before

    def _run_once(self, shapes: list[tuple[int, int, int]]) -> None:
        """Run each warmed-up step and block copy once, on inputs whose KV reads and writes
        stay in the null block, which no request reads. An executable's first run pays
        one-time costs that compiling did not (on XLA:CPU, probably its kernels generated
        lazily: with the 57M benchmark model a prompt's first step of a new bucket took ~0.1 s
        more than the next, and the first requests of a server waited for it).

        An all-padding batch has no rows, so it skips the attention work: after running on one,
        a bucket's first real step still took ~18 ms more than the next (20 ms, greedy or
        sampled alike), and after a batch without a prefill chunk that follows cached context,
        a bucket's first such chunk took 10-20 ms more. So each step runs on
        PreparedBatch.null_block, whose rows decode and continue a prefill over the null
        block; after that, first steps took what later ones do (docs/benchmarks.md, Serving).

        Runs after warmed_up is set, so that a compilation here would be reported as one.
        """
        for t, r, b in shapes:
            batch = PreparedBatch.null_block(t, r, b, self.block_size)
            for widths in self.sampling.variant_widths:
                self.run_prepared(batch, self._neutral_sampling(r, widths))
        for n in self.copy_sizes:
            self.kv_caches = self._copy(self.kv_caches, *(np.zeros(n, np.int32),) * 2)
        jax.block_until_ready(self.kv_caches)

    def _neutral_sampling(self, padded_rows: int, widths: tuple[int, int]) -> SamplingMetadata:
        """Neutral sampling rows with sampling lists of ``widths`` (penalty, ban)."""
        penalty_width, ban_width = widths
        return SamplingMetadata.neutral(
            padded_rows, self.vocab_size, penalty_width=penalty_width, ban_width=ban_width
        )

    def _padding_step_inputs(
        self, padded_tokens: int, padded_rows: int, width: int, widths: tuple[int, int]
    ) -> tuple[Any, ...]:
        """The step's arguments after params and KV pages for an all-padding batch of this
        bucket, with sampling lists of ``widths``."""
        batch = PreparedBatch.padding(padded_tokens, padded_rows, width)
        return (
            batch.input_ids,
            _attention_metadata(batch, self.rope_tables, self.kv_scales),
            batch.logits_indices,
            self._neutral_sampling(padded_rows, widths),
            np.full(padded_tokens, -1, np.int32),  # no prompt-logprob targets
        )

    # ---- per step -------------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.device_to_host or so.host_to_device:
            # Before anything writes the pages: the step reuses the evicted blocks.
            self.kv_caches = self.kv_offload.apply(
                self.kv_caches, so.device_to_host, so.host_to_device
            )
        if so.block_copies:
            # Pad to a power of two with null-block self-copies: few compiled shapes.
            pairs = np.zeros((1 << (len(so.block_copies) - 1).bit_length(), 2), np.int32)
            pairs[: len(so.block_copies)] = so.block_copies
            self.kv_caches = self._copy(self.kv_caches, pairs[:, 0], pairs[:, 1])
        if so.is_empty:
            return ModelRunnerOutput()
        start = time.perf_counter()
        req_ids = list(so.num_scheduled_tokens)
        num_scheduled = np.fromiter(so.num_scheduled_tokens.values(), np.int32, len(req_ids))
        padded_tokens = self.buckets.padded_tokens(int(num_scheduled.sum()))
        padded_rows = self.buckets.padded_rows(padded_tokens)
        batch = self.input_batch.prepare(
            req_ids, num_scheduled, padded_tokens, padded_rows, self.buckets.padded_width
        )
        ib = self.input_batch
        output_pos = ib.num_tokens[batch.slots] - ib.num_prompt_tokens[batch.slots]
        sampling_md = self.sampling.build(batch.slots, padded_rows, output_pos)
        targets = self._prompt_logprob_targets(batch)
        if self.trace is not None:
            self._trace_batch(batch, sampling_md, time.perf_counter() - start)
        out, plp = self.run_prepared(batch, sampling_md, targets)
        return self._collect(batch, out, plp)

    def run_prepared(
        self,
        batch: PreparedBatch,
        sampling_md: SamplingMetadata,
        prompt_targets: np.ndarray | None = None,  # i32[T]; None: no prompt logprobs
    ) -> tuple[Any, Any]:
        """Run the jitted step on a prepared batch (its KV writes land in the pages).

        The engine's path after the host arrays are built; benchmarks call it directly with
        synthetic batches of a bucket's shape. Returns the sampler's output and the prompt
        logprobs, on device.
        """
        if prompt_targets is None:
            prompt_targets = np.full(batch.input_ids.shape, -1, np.int32)
        start = time.perf_counter()
        self.kv_caches, out, plp = self._step(
            self.params,
            self.kv_caches,
            batch.input_ids,
            _attention_metadata(batch, self.rope_tables, self.kv_scales),
            batch.logits_indices,
            sampling_md,
            prompt_targets,
        )
        if self.trace is not None:
            self.trace.dispatch_s = time.perf_counter() - start
            jax.block_until_ready(out.token_ids)
            self.trace.device_s = time.perf_counter() - start
        return out, plp

    def _trace_batch(self, batch: PreparedBatch, sampling_md: SamplingMetadata, secs: float):
        rows = len(batch.req_ids)
        trace = self.trace
        trace.prepare_s = secs
        trace.padded_tokens = int(batch.input_ids.shape[0])
        trace.padded_rows, trace.table_width = (int(n) for n in batch.block_tables.shape)
        trace.q_lens = np.array(batch.num_scheduled[:rows], np.int32)
        trace.seq_lens = np.array(batch.seq_lens[:rows], np.int32)
        trace.all_greedy = bool((np.asarray(sampling_md.temperature)[:rows] <= 0).all())

    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        for req_id in so.finished_req_ids:
            self._prompt_logprobs.pop(req_id, None)
            self._num_logprobs.pop(req_id, None)
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            slot = ib.remove(req_id)
            if slot is not None:
                self.sampling.clear(slot)
        for new in so.scheduled_new_reqs:
            slot = ib.add(
                new.req_id,
                new.token_ids,
                new.num_prompt_tokens,
                new.block_ids,
                new.num_computed_tokens,
            )
            prompt, outputs = (
                new.token_ids[: new.num_prompt_tokens],
                new.token_ids[new.num_prompt_tokens :],
            )
            self.sampling.set_request(slot, new.sampling_params, new.seed, prompt, outputs)
            if new.sampling_params.logprobs is not None:
                self._num_logprobs[new.req_id] = new.sampling_params.logprobs
            n = new.sampling_params.prompt_logprobs
            if n is not None and new.req_id not in self._prompt_logprobs:
                self._prompt_logprobs[new.req_id] = _PromptLogprobsState(n)
        for cached in so.scheduled_cached_reqs:
            ib.update_cached(cached.req_id, cached.num_computed_tokens, cached.new_block_ids)

    def _prompt_logprob_targets(self, batch: PreparedBatch) -> np.ndarray:
        """i32[T] next prompt token of every scheduled row of a request that still owes prompt
        logprobs, -1 elsewhere (all -1: the step computes no prompt logprobs)."""
        targets = np.full(batch.input_ids.shape, -1, np.int32)
        ib = self.input_batch
        for row, start, n in self._rows_owing_prompt_logprobs(batch):
            slot = batch.slots[row]
            nxt = batch.positions[start : start + n] + 1  # the token each position predicts
            ok = nxt < ib.num_prompt_tokens[slot]
            targets[start : start + n] = np.where(ok, ib.token_ids[slot, np.where(ok, nxt, 0)], -1)
        return targets

    def _rows_owing_prompt_logprobs(self, batch: PreparedBatch):
        """(row, first token row, scheduled tokens) of requests still owed prompt logprobs."""
        if not self._prompt_logprobs:
            return
        starts = batch.query_start_loc
        for row, req_id in enumerate(batch.req_ids):
            state = self._prompt_logprobs.get(req_id)
            if state is not None and not state.done:
                yield row, int(starts[row]), int(batch.num_scheduled[row])

    def _collect(self, batch: PreparedBatch, out: Any, plp: Any) -> ModelRunnerOutput:
        """Sampled tokens (and logprobs) back to the host; the persistent rows learn them."""
        rows = np.flatnonzero(batch.sampling_rows)
        token_ids = np.asarray(out.token_ids)[rows]
        slots = batch.slots[rows]
        self.input_batch.append_tokens(slots, token_ids)
        self.sampling.append_output_tokens(slots, token_ids)
        req_ids = [batch.req_ids[r] for r in rows.tolist()]
        result = ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=[[t] for t in token_ids.tolist()]
        )
        wanted = self._num_logprobs
        if wanted and any(req_id in wanted for req_id in req_ids):
            host = jax.device_get(out)
            width = logprobs_width(self.vocab_size)
            for r, req_id in zip(rows.tolist(), req_ids, strict=True):
                num = wanted.get(req_id)
                if num is not None:
                    result.logprobs[req_id] = [host.token_logprobs(r, min(num, width))]
        if self._prompt_logprobs and any(True for _ in self._rows_owing_prompt_logprobs(batch)):
            self._collect_prompt_logprobs(batch, jax.device_get(plp), result)
        return result

    def _collect_prompt_logprobs(self, batch: PreparedBatch, plp: Any, result) -> None:
        """Prompt logprobs of the positions computed this step, each emitted once (a request
        preempted mid-prompt recomputes positions it already reported: they are skipped)."""
        ib = self.input_batch
        for row, start, n in list(self._rows_owing_prompt_logprobs(batch)):
            req_id = batch.req_ids[row]
            state = self._prompt_logprobs[req_id]
            num_prompt = int(ib.num_prompt_tokens[batch.slots[row]])
            first = int(batch.positions[start])
            # Position p predicts prompt token p + 1; emit p in [state.next_pos, num_prompt - 1).
            lo = max(first, state.next_pos)
            hi = min(first + n, num_prompt - 1)
            if hi > lo:
                rows = np.arange(start + lo - first, start + hi - first)
                result.prompt_logprobs[req_id] = to_token_logprobs(
                    plp.logprobs[rows],
                    plp.token_ids[rows],
                    plp.ranks[rows],
                    min(state.num, logprobs_width(self.vocab_size)),
                )
                state.next_pos = hi
            if state.next_pos >= num_prompt - 1:
                state.done = True


STEP_ARGS = (  # the step's positional arguments, named for compilation explanations
    "params",
    "kv_caches",
    "input_ids",
    "attention_metadata",
    "logits_indices",
    "sampling_metadata",
    "prompt_targets",
)
COPY_ARGS = ("kv_caches", "src", "dst")


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
    params: Any,
    kv_caches: list[tuple[jax.Array, jax.Array]],
    input_ids: jax.Array,  # i32[T]
    md: AttentionMetadata,
    logits_indices: jax.Array,  # i32[R]
    sampling_md: SamplingMetadata,
    prompt_targets: jax.Array,  # i32[T] next prompt token per row (prompt logprobs), else -1
):
    """The jitted step: forward, logits at the R sampling rows, sample, and the prompt logprobs
    of the rows that owe them (the [T, V] logits only when some row does: a run-time test)."""
    kv_caches, hidden = model.forward(params, kv_caches, input_ids, md)  # [T, D]
    logits = model.compute_logits(params, hidden[logits_indices])  # f32[R, V]
    out = sample(logits, sampling_md, draw=draw)
    num = logprobs_width(model.arch.vocab_size)
    plp = lax.cond(
        jnp.any(prompt_targets >= 0),
        lambda: prompt_logprobs(model.compute_logits(params, hidden), prompt_targets, num=num),
        lambda: no_logprobs(prompt_targets.shape[0], num),
    )
    return kv_caches, out, plp


def _all_ready(arrays: Any) -> bool:
    """Whether every array is alive and its computation succeeded."""
    leaves = jax.tree.leaves(arrays)
    if any(x.is_deleted() for x in leaves):
        return False
    try:
        jax.block_until_ready(leaves)
    except Exception:  # an asynchronous failure of the computation that produced them
        return False
    return True


@dataclass
class _PromptLogprobsState:
    num: int  # top-N asked
    next_pos: int = 0  # next position whose prediction (of prompt token next_pos + 1) is owed
    done: bool = False


def _attention_metadata(
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
        seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc,
        num_seqs=batch.num_seqs,
        kv_scales=kv_scales,
        **rope,
    )


def _jit_shardings(
    plan: ShardingPlan | None, num_layers: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """jax.jit sharding arguments of the step and of the block copy: every argument and result
    explicit (params and pages as planned, host inputs and sampled results replicated), so
    warm-up and serving hit the same executables. No plan: jit's defaults (one device)."""
    if plan is None:
        return {}, {}
    kv, rep = plan.kv_shardings(num_layers), plan.replicated
    step = dict(
        # params, kv_caches, input_ids, md, logits_indices, sampling_md, prompt_targets
        in_shardings=(plan.param_shardings(), kv, rep, rep, rep, rep, rep),
        out_shardings=(kv, rep, rep),  # kv_caches, sampler output, prompt logprobs
    )
    return step, dict(in_shardings=(kv, rep, rep), out_shardings=kv)


def _copy_blocks(kv_caches, src: jax.Array, dst: jax.Array):
    """Copy-on-write: pages src[i] -> dst[i] in every layer (K and V). In place (donated)."""
    return [(k.at[:, dst].set(k[:, src]), v.at[:, dst].set(v[:, src])) for k, v in kv_caches]
