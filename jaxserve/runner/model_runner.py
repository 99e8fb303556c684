"""ModelRunner: SchedulerOutput in, sampled tokens out; two jitted halves per engine step.

    dispatch_forward(scheduler_output)    rows updated, padded host arrays for (T, R, B)
        forward(params, kv_caches, ...)   jit: forward, logits f32[R, V]; KV donated
    dispatch_sample(forward_step, masks)  the token masks written into the sampling rows
        sample(logits, ...)               jit: sampler, rejection sampler, samples recorded
        -> InFlightStep                   returns while the device runs the step
    collect(in_flight_step)
        -> ModelRunnerOutput              only the sampled ids (and logprobs) come back

``dispatch`` is both halves (the SchedulerOutput's masks). Where the plan fuses the halves (the
CPU: fused_step.py), ``dispatch_forward`` only stages the step and ``dispatch_sample`` runs
the one fused program; the calls and their order are the same. The next step may be dispatched
before this one is collected (async scheduling: its placeholder inputs read this step's samples
on device, token_feed.py), and the step before may be collected between a step's two halves
(its tokens advance the grammar matchers whose masks the sample half takes: EngineCore).
The pure halves and the block copy are step.py; the host arrays step_inputs.py; collecting
in_flight.py; warm-up warmup.py. Compiled: the forward per (T, R, B) bucket, the sample per
(R, sampler list widths), the block copy per padded size; warm-up compiles all of them and
every compilation after it is explained (step_compiles.py).

Speculative decoding: a request's drafts get a logits row each plus one (spec_rows.py); the
sample half verifies them (rejection_sampler.py; a draft model's sampled drafts with their q,
DraftModel.q_rows_of) and ``collect`` hands back the accepted drafts and one more token; a
draft model runs in the forward half and proposes after the step (``spec_proposer``).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.models import CausalLM
from jaxserve.outputs import ModelRunnerOutput
from jaxserve.runner.buckets import BucketSpec
from jaxserve.runner.draft_model import DraftModel, DraftSpec
from jaxserve.runner.fused_step import FUSED_ARGS, jit_fused
from jaxserve.runner.in_flight import ForwardStep, InFlightStep, collect
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.job_shapes import WarmupSet
from jaxserve.runner.kv_cache import KVAllocator, allocate_kv_caches, pages_usable
from jaxserve.runner.kv_connector_worker import KVConnectorWorker
from jaxserve.runner.kv_offload import KVOffloader
from jaxserve.runner.map_budget import max_step_shapes
from jaxserve.runner.plan import ExecutionPlan
from jaxserve.runner.prompt_logprobs import PromptLogprobs
from jaxserve.runner.sampling_metadata import SamplingInputs
from jaxserve.runner.sharding import ShardingPlan
from jaxserve.runner.step import (
    COPY_ARGS,
    FORWARD_ARGS,
    SAMPLE_ARGS,
    jit_copy,
    jit_forward,
    jit_sample,
    padded_copies,
)
from jaxserve.runner.step_calls import StepCalls
from jaxserve.runner.step_compiles import StepCompiles
from jaxserve.runner.step_inputs import prepare_step, update_states
from jaxserve.runner.step_trace import StepTrace
from jaxserve.runner.token_feed import initial_last_sampled
from jaxserve.runner.warmup import warm_up


class ModelRunner(StepCalls):
    """Owns the device state (params, KV pages) and the host mirrors of the batch.

    Args:
        model: the CausalLM (static config; params passed separately).
        params: its parameters, already on device (abstract with an abstract kv_allocator).
        num_kv_blocks: pages in the pool, null block 0 included.
        block_size, max_num_seqs, max_num_batched_tokens, max_model_len: as the engine config.
        eos_token_ids: for min_tokens bans.
        sharding: where params, KV pages and step inputs live (tensor parallelism; the
            params must already be placed by it), or None: the default device.
        plan: the execution plan (buckets, host RoPE rows, sampler draw, KV pages' dtype).
        kv_scales: host f32[L, 2] (k_scale, v_scale) per layer of an FP8 KV cache
            (runner/kv_scales.py), sent with every step's AttentionMetadata; None otherwise.
        kv_offload: the host KV tier's data side (kv_offload.py) when there is one, else None.
        kv_connector: the KV connector's runner half (kv_connector_worker.py), or None.
        draft: speculative decoding's draft model (draft_model.py), or None.
        kv_allocator: makes the KV pages (kv_cache.abstract_kv_caches: compile, never run).
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
        kv_offload: KVOffloader | None = None,
        draft: DraftSpec | None = None,
        kv_allocator: KVAllocator = allocate_kv_caches,
        kv_connector: KVConnectorWorker | None = None,
    ) -> None:
        self.model = model
        self._kv_allocator = kv_allocator
        self.kv_scales = kv_scales
        self.kv_offload = kv_offload
        self.kv_connector = kv_connector
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
        self.buckets = BucketSpec.of_plan(
            plan, max_num_batched_tokens, max_num_seqs, self.input_batch.max_blocks_per_seq,
            length_bounded=model.attention.length_bounded,
            max_shapes=max_step_shapes(
                plan.max_executables, len(self.sampling.variant_widths), len(self.copy_sizes)
            ),
        )  # fmt: skip
        self.kv_caches = self._allocate_kv_caches()
        # Per slot, the last token its request sampled, on device: the next step's
        # placeholder inputs read it (token_feed.py).
        self.last_sampled = initial_last_sampled(max_num_seqs, sharding, like=self.kv_caches)
        self.warmed: set = set()  # steps and block copies warm-up ran (warmup.py)
        self.draft = None
        if draft is not None:
            rows = tuple(sorted({self.buckets.padded_rows(t) for t in self.buckets.token_buckets}))
            self.draft = DraftModel.create(draft, self.input_batch, num_kv_blocks, block_size,
                                           rows, kv_allocator)  # fmt: skip
        self._init_jitted()

    def _init_jitted(self) -> None:
        """The step's two jitted halves and the block copy (step.py), each counted by its
        StepCompiles. They hold the model, never the runner: nothing of the runner is in a
        reference cycle, so dropping the last LLM frees its device memory at once."""
        draft = self.draft
        drafting = () if draft is None else (draft.model, draft.sharding)
        self.forward_compiles = fwd = StepCompiles("the engine step's forward", fixed_args=2)
        self.jitted_forward = forward = jit_forward(self.model, self.sharding, *drafting)
        self._forward = lambda *args: fwd(forward, args, FORWARD_ARGS)
        self.sample_compiles = smp = StepCompiles("the engine step's sample")
        self.jitted_sample = sample = jit_sample(self.plan.sampler_draw, self.sharding)
        self._sample = lambda *args: smp(sample, args, SAMPLE_ARGS)
        # The plan's fused step (fused_step.py): one program instead of the two halves.
        self.fused_compiles = None
        if self.plan.fused_step:
            self.fused_compiles = fused = StepCompiles("the engine step", fixed_args=2)
            self.jitted_fused = step = jit_fused(
                self.model, self.sharding, self.plan.sampler_draw, *drafting
            )
            self._fused = lambda *args: fused(step, args, FUSED_ARGS)
        self.copy_compiles = copies = StepCompiles("the copy-on-write block copy", fixed_args=1)
        self.jitted_copy = copy = jit_copy(self.sharding, self.model.arch.num_layers)
        self._copy = lambda *args: copies(copy, args, COPY_ARGS)

    def _init_host_state(self) -> None:
        """Empty host mirrors: batch rows, sampling settings, logprob bookkeeping."""
        self.input_batch = InputBatch(self.max_num_seqs, self.max_model_len, self.block_size)
        self.sampling = SamplingInputs(
            self.max_num_seqs, self.vocab_size, self.max_model_len, eos_token_ids=self.eos_token_ids
        )
        # Prompt-logprobs progress per request; kept across preemption, dropped when finished.
        self._prompt_logprobs = PromptLogprobs(self.vocab_size)
        self._num_logprobs: dict[str, int] = {}  # req_id -> top-N logprobs asked

    def _allocate_kv_caches(self) -> list[tuple[jax.Array, jax.Array]]:
        model = self.model
        return self._kv_allocator(
            model.arch.num_layers,
            model.kv_cache_shape(self.num_kv_blocks, self.block_size),
            self.plan.kv_cache_dtype,
            None if self.sharding is None else self.sharding.kv_sharding,
        )

    @property
    def max_num_sampling_rows(self) -> int:
        return self.buckets.max_rows  # the largest row bucket: requests plus drafts

    @property
    def spec_proposer(self) -> DraftModel | None:
        """The draft model, which proposes speculative drafts (the Proposer protocol); None
        without one (n-gram drafts are proposed on the host)."""
        return self.draft

    @property
    def is_idle(self) -> bool:
        """True when the runner holds no request: no batch row, no logprob bookkeeping."""
        return not len(self.input_batch) and not self._prompt_logprobs and not self._num_logprobs

    @property
    def num_compilations(self) -> int:
        """XLA compilations so far (not those loaded from the cache: the hits)."""
        return sum(c.num_fresh for c in self.all_compiles())

    @property
    def num_compilation_cache_hits(self) -> int:
        return sum(c.num_cache_hits for c in self.all_compiles())

    @property
    def recompilations(self) -> list[dict[str, Any]]:
        """Every compilation after warm-up, with what was new (step_compiles.py)."""
        return [event for c in self.all_compiles() for event in c.events]

    def all_compiles(self) -> list[StepCompiles]:
        """The counters of every jitted function the runner calls."""
        copies = (self.kv_offload, self.kv_connector and self.kv_connector.staging)
        offload = [c.compiles for c in copies if c is not None]
        draft = [self.draft.compiles, self.draft.copy_compiles] if self.draft is not None else []
        return [*self.step_compiles(), *offload, *draft]

    def step_compiles(self) -> list[StepCompiles]:
        """The counters of the step's programs (its halves, or the fused step) and the block
        copy: what warm-up runs, and what the executable store serves."""
        steps = [self.forward_compiles, self.sample_compiles]
        if self.fused_compiles is not None:
            steps.append(self.fused_compiles)
        return [*steps, self.copy_compiles]

    def close(self) -> None:
        """Stop what the runner owns that runs on its own: the KV connector's threads and
        transfer server (the engine shuts down). The host KV tier holds host arrays only,
        freed with the runner. Idempotent."""
        if self.kv_connector is not None:
            self.kv_connector.close()

    def reset(self) -> bool:
        """Forget every request: the recovery of an engine step that raised part-way. The host
        buffers are rebuilt empty. The KV pages survive unless the failed step left them
        unusable (donated to a jitted call whose result was never stored, or poisoned by a
        failed computation); then they are reallocated, zeroed, and it returns True: every
        cached prefix is gone, and the scheduler must drop its prefix cache."""
        self._init_host_state()
        if self.kv_connector is not None:
            self.kv_connector.reset()
        if self.draft is not None:  # only guesses live in its pages: nothing to report
            self.draft.reset(self.input_batch, pages_ok=pages_usable(self.draft.kv_caches))
        if pages_usable(self.kv_caches):
            return False
        self.kv_caches = None  # release the dead buffers before allocating new ones
        self.kv_caches = self._allocate_kv_caches()
        return True

    # ---- compilation ------------------------------------------------------------------------
    def warmup(
        self,
        shapes: list[tuple[int, int, int]] | None = None,
        workers: int = 1,
        *,
        what: WarmupSet | None = None,
    ) -> int:
        """Compile what ``what`` lists (default: warmup_set(shapes); a job's set:
        job_shapes.py), ``workers`` at a time, then run each once (warmup.py). Returns the
        number of compilations this caused (fresh or from the cache)."""
        if what is None:
            what = self.warmup_set(shapes)
        return warm_up(self, what, workers)

    def warmup_set(self, shapes: list[tuple[int, int, int]] | None = None) -> WarmupSet:
        """``shapes`` (default: every bucket), every sampler variant, every block copy."""
        shapes = shapes or self.buckets.all_shapes()
        return WarmupSet(tuple(shapes), self.sampling.variant_widths, self.copy_sizes)

    def measure_offload_bandwidth(self) -> tuple[float, float]:
        """(bytes/s, latency s) of the host KV tier's copies (KVOffloader.measure_bandwidth)."""
        self.kv_caches, bytes_per_s, latency_s = self.kv_offload.measure_bandwidth(self.kv_caches)
        return bytes_per_s, latency_s

    # ---- per step -------------------------------------------------------------------------
    def execute_model(
        self, so: SchedulerOutput, trace: StepTrace | None = None
    ) -> ModelRunnerOutput:
        """Run one engine step and collect it; ``trace``, when given, is filled in with the
        step's batch shape and its host and device times (step_trace.py)."""
        return self.collect(self.dispatch(so, trace))

    def collect(self, step: InFlightStep) -> ModelRunnerOutput:
        """A dispatched step's sampled tokens (and logprobs) on the host (in_flight.py)."""
        return collect(step, self.input_batch, self.sampling, self._num_logprobs,
                       self._prompt_logprobs, self.vocab_size)  # fmt: skip

    def dispatch(self, so: SchedulerOutput, trace: StepTrace | None = None) -> InFlightStep:
        """Start one engine step (both halves, the token masks of ``so``) and return without
        waiting for the device. Its requests' samples are pending (InputBatch.num_pending)
        until it is collected; the next step may be dispatched before that (its placeholder
        inputs read them on device)."""
        return self.dispatch_sample(self.dispatch_forward(so, trace), so.token_masks)

    def dispatch_forward(
        self, so: SchedulerOutput, trace: StepTrace | None = None, masks_later: Any = ()
    ) -> ForwardStep:
        """Start a step's forward half (``dispatch_sample`` starts the rest). The rows of
        ``masks_later`` (ids of requests whose masks are built later) take the list variant."""
        update_states(so, self.input_batch, self.sampling, self._prompt_logprobs,
                      self._num_logprobs)  # fmt: skip
        if so.device_to_host or so.host_to_device:
            # Before anything writes the pages: the step reuses the evicted blocks.
            self.kv_caches = self.kv_offload.apply(
                self.kv_caches, so.device_to_host, so.host_to_device
            )
        connector = so.kv_connector if self.kv_connector is not None else None
        kv_loads = {}
        if self.kv_connector is not None:  # KV from other engines (kv_connector_worker.py)
            idle = so.is_empty and not len(self.input_batch)  # may wait a little for a load
            self.kv_caches, kv_loads = self.kv_connector.before_forward(self.kv_caches, so, idle)
        if so.block_copies:
            self.copy_blocks(*padded_copies(so.block_copies))
        if so.is_empty:
            return ForwardStep(kv_loads=kv_loads)
        start = time.perf_counter()
        batch, sampling_md, mask_rows = prepare_step(
            so, self.input_batch, self.sampling, self.buckets, masks_later
        )
        targets = self._prompt_logprobs.targets(batch, self.input_batch)
        if trace is not None:
            trace.record_batch(batch, sampling_md.temperature, time.perf_counter() - start)
        forward = self.run_forward(batch, targets, trace)
        save = connector if connector is not None and connector.after_forward else None
        return ForwardStep(batch, sampling_md, mask_rows, forward, trace, kv_loads, save)

    def dispatch_sample(
        self, fwd: ForwardStep, token_masks: dict[str, np.ndarray] | None = None
    ) -> InFlightStep:
        """Start the sample half after ``dispatch_forward``, with ``token_masks`` (req_id ->
        u32[M]) for its ``masks_later`` rows (a row without one: its request finished)."""
        batch = fwd.batch
        if batch is None:
            return InFlightStep(kv_loads=fwd.kv_loads)
        fwd.write_masks(token_masks or {})
        out, num_emitted, plp = self.run_sample(batch, fwd.forward, fwd.sampling_md, fwd.trace)
        if fwd.save_kv is not None:
            # The blocks this step completes (the gather waits for it: a producer's step that
            # saves does not overlap the next one's scheduling).
            self.kv_caches = self.kv_connector.save(self.kv_caches, fwd.save_kv)
        self.input_batch.num_pending[batch.slots[batch.sampling_rows]] += 1
        return InFlightStep(batch, out, plp, num_emitted, fwd.kv_loads)

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy-on-write: KV pages src[i] -> dst[i], in place (a padded count: copy_sizes)."""
        self.kv_caches = self._copy(self.kv_caches, src, dst)
        if self.draft is not None:
            self.draft.copy_blocks(src, dst)
