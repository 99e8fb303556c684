"""Warm-up: compile step shapes ahead of time, then run each once.

What it compiles is a WarmupSet (job_shapes.py). A server's (and LLMEngine's) is the full set:
the step's forward half for every (T, R, B) bucket, its sample half for every row bucket R in
both sampler variants (a batch without penalties or bans, and one with them at the one width
every accepted request fits: SamplingInputs.variant_widths), the copy-on-write block copy (n >
1) for every size of the runner's copy_sizes. An offline job's is the part of it that its
requests can reach (job_shapes.job_warmup_set), warmed up before the job's first step; a later
job adds what it needs more. Always the host KV tier's and the KV connector's copies when
there is one, and a draft model's proposal at every row bucket (with its pages' block copies)
when speculative decoding has one. Every other sampling feature (greedy or sampled rows, seeds,
logprobs, prompt logprobs, min_tokens) runs in these same compiled steps.

Each is lowered and compiled ahead of time, ``workers`` at a time (threads: XLA compiles without
the GIL), for the arguments of an all-padding batch. jax keeps the executables, and the engine's
calls with the same shapes run them without tracing again (tests/runner/test_warmup.py). Then
each runs once (``run_once``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxserve.runner.draft_model import PROPOSE_ARGS, DraftModel
from jaxserve.runner.fused_step import FUSED_ARGS
from jaxserve.runner.input_batch import PreparedBatch
from jaxserve.runner.job_shapes import Shape, WarmupSet
from jaxserve.runner.sampling_metadata import SamplingMetadata
from jaxserve.runner.startup import checked
from jaxserve.runner.step import COPY_ARGS, FORWARD_ARGS, SAMPLE_ARGS, attention_metadata
from jaxserve.runner.step_compiles import Compilation, compile_concurrently, signature
from jaxserve.runner.token_feed import NO_SLOT, TokenFeed

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import ModelRunner

Step = tuple[Shape, tuple[int, int]]  # a step shape (T, R, B) and its sampler list widths

logger = logging.getLogger("jaxserve")

# Executables loaded from the store at once: deserializing releases the GIL (on the 2-core CPU,
# 13 of the demo's took 8.4 s one at a time and 5.8 s two at a time), where compiling on the
# CPU gains nothing from threads (plan.compile_workers).
LOAD_WORKERS = min(4, os.cpu_count() or 1)


class ServerWarmup:
    """A server's warm-up (every bucket: ModelRunner.warmup_set) in its two halves: ``compile``
    needs only the runner's shapes (it may run while the weights load: startup.py), ``run``
    runs each step once on the loaded weights, then logs the count and the seconds.

    Args:
        workers: compilations at a time.
        select: (the full set) -> the part to warm up now; default all of it. A server that
            serves before its warm-up ends takes the first stage (warmup_stages.py) and
            compiles the rest in the background (engine/background_warmup.py).
    """

    def __init__(
        self, workers: int, select: Callable[[WarmupSet], WarmupSet] | None = None
    ) -> None:
        self.workers = workers
        self._select = select or (lambda what: what)
        self._start: float | None = None

    def compile(
        self, runner: ModelRunner, checks: Callable[[], None] | None = None, ckpt: Any = None
    ) -> None:
        """Compile the (selected) full set, calling ``checks()`` before each compilation;
        ``ckpt`` (the checkpoint the runner was built from) is not needed: startup.py's
        compile_all passes it for a job's set (job_startup.py)."""
        if self._start is None:
            self._start = time.perf_counter()
        compile_set(runner, self._select(runner.warmup_set()), self.workers, checks)

    def run(self, runner: ModelRunner) -> None:
        run_set(runner, self._select(runner.warmup_set()))
        logger.info(
            "warm-up: %d compilations (%d loaded from the compilation cache) in %.1f s, "
            "%d at a time",
            runner.num_compilations + runner.num_compilation_cache_hits,
            runner.num_compilation_cache_hits,
            time.perf_counter() - (self._start or time.perf_counter()),
            self.workers,
        )


def warm_up(runner: ModelRunner, what: WarmupSet, workers: int) -> int:
    """Compile what ``what`` lists (and the host tier's and a draft model's functions) for
    ``runner``, ``workers`` at a time, then run each step shape and block copy once. Calls
    after the first add what is new (a job's shapes, job_shapes.py): what an earlier one
    compiled and ran is neither compiled nor run again.

    Returns the number of compilations this caused (fresh or loaded from the cache);
    compilations outside warm-up are explained in the log (step_compiles.py).
    """
    not_run = _not_run_fused if runner.fused_compiles is not None else _not_run
    if runner.warmed and not any(not_run(set(runner.warmed), what)):
        return 0  # every step and block copy of ``what`` ran before (so compiled): nothing new
    before = runner.num_compilations + runner.num_compilation_cache_hits
    compile_set(runner, what, workers)
    run_set(runner, what)
    return runner.num_compilations + runner.num_compilation_cache_hits - before


def compile_set(
    runner: ModelRunner,
    what: WarmupSet,
    workers: int,
    checks: Callable[[], None] | None = None,
) -> None:
    """Warm-up's first half: compile (or load from the executable store) what ``what`` lists,
    calling ``checks()`` before each (it raises to stop them: startup.py's failed load).
    Needs the runner's shapes only: its params may be abstract."""
    for compiles in runner.all_compiles():
        compiles.begin_warmup()
    try:
        compile_jobs(*split_stored(compilations(runner, what)), workers, checks)
    finally:
        for compiles in runner.all_compiles():
            compiles.finish_warmup()


def compile_jobs(
    stored: list[Compilation],
    rest: list[Compilation],
    workers: int,
    checks: Callable[[], None] | None = None,
) -> None:
    """Load the ``stored`` jobs from the executable store (LOAD_WORKERS at a time), then
    compile the ``rest``, ``workers`` at a time, calling ``checks()`` before each."""
    if checks is not None:
        stored, rest = checked(stored, checks), checked(rest, checks)
    compile_concurrently(stored, LOAD_WORKERS)
    compile_concurrently(rest, workers)


def run_set(runner: ModelRunner, what: WarmupSet) -> None:
    """Warm-up's second half, on the loaded weights: run each step shape and block copy of
    ``what`` not run before once, then save the executables that ran to the store."""
    not_run = _not_run_fused if runner.fused_compiles is not None else _not_run
    run_once(runner, *not_run(runner.warmed, what))
    # Only the step's programs and the block copy have run (run_once): only they are serialized.
    ran = runner.step_compiles()
    for compiles in runner.all_compiles():
        compiles.save_ran(any(compiles is c for c in ran))


def split_stored(jobs: list[Compilation]) -> tuple[list[Compilation], list[Compilation]]:
    """(the jobs whose executable the store holds, the others)."""
    stored, rest = [], []
    for job in jobs:
        store = job.compiles.store
        hit = store is not None and store.has(job.compiles.name, signature(job.args, job.names, {}))
        (stored if hit else rest).append(job)
    return stored, rest


def _not_run(warmed: set, what: WarmupSet) -> tuple[list[Step], list[int]]:
    """The steps (shape, sampler widths) and block-copy sizes of ``what`` that no earlier
    warm-up ran, now recorded in ``warmed``: each forward shape once (with a sampler variant
    of its R not run yet, if any), then a step of the smallest shape of each R for every
    sample variant still not run."""
    steps = []
    samples = [s for s in what.samples if ("sample", *s) not in warmed]
    for shape in what.shapes:
        if ("forward", shape) in warmed:
            continue
        widths = next((w for r, w in samples if r == shape[1]), what.variants[0])
        steps.append((shape, widths))
        warmed.update({("forward", shape), ("sample", shape[1], widths)})
        samples = [s for s in samples if s != (shape[1], widths)]
    for r, widths in samples:
        if ("sample", r, widths) not in warmed:
            shape = min(s for s in what.shapes if s[1] == r)
            steps.append((shape, widths))
            warmed.add(("sample", r, widths))
    copies = [("copy", n) for n in what.copy_sizes if ("copy", n) not in warmed]
    warmed.update(copies)
    return steps, [n for _, n in copies]


def _not_run_fused(warmed: set, what: WarmupSet) -> tuple[list[Step], list[int]]:
    """_not_run with the plan's fused step: each (shape, sampler widths) of the fused shapes
    (job_shapes.fused_shape) is an executable of its own, run once; the other shapes as
    _not_run runs them."""
    together, apart = what.parts()
    steps = [s for s in together.steps if ("fused", *s) not in warmed]
    warmed.update(("fused", *s) for s in steps)
    split, copies = _not_run(warmed, apart)
    return steps + split, copies


def compilations(runner: ModelRunner, what: WarmupSet) -> list[Compilation]:
    """The compilations warm-up runs, smallest first: the block copies; with the plan's fused
    step, the fused program for each sampler variant of each shape job_shapes.fused_shape takes
    (the decode buckets, T = R <= 64, smallest first) instead of its two halves; then the
    forward half for each other shape of ``what`` (in its order: the smallest T first), each
    followed by the sample half of its row bucket R in every sampler variant of ``what`` not
    listed yet (so each prefix of the split list runs every step up to its largest T); then the
    host KV tier's copies and a draft model's functions."""
    jobs = _copy_compilations(runner.copy_compiles, runner.jitted_copy, runner.kv_caches,
                              what.copy_sizes)  # fmt: skip
    if runner.fused_compiles is not None:  # the fused shapes' programs, the others' halves
        together, apart = what.parts()
        jobs += _fused_compilations(runner, together) + _split_compilations(runner, apart)
    else:
        jobs += _split_compilations(runner, what)
    if runner.kv_offload is not None:
        jobs += runner.kv_offload.compilations(runner.kv_caches)
    if runner.kv_connector is not None:  # its staging copies (kv_connector_worker.py)
        jobs += runner.kv_connector.staging.compilations(runner.kv_caches)
    if runner.draft is not None:
        jobs += _draft_compilations(runner)
    return jobs


def _split_compilations(runner: ModelRunner, what: WarmupSet) -> list[Compilation]:
    """The forward half at each shape of ``what`` (its order), each followed by the sample half
    of its row bucket R in every sampler variant of ``what`` not listed yet."""
    jobs = []
    samples = list(what.samples)
    for t, r, b in what.shapes:
        forward = (runner.params, runner.kv_caches, *padding_forward_inputs(runner, t, r, b))
        jobs.append(Compilation(runner.forward_compiles, runner.jitted_forward, forward,
                                FORWARD_ARGS))  # fmt: skip
        jobs += [_sample_compilation(runner, rows, widths) for rows, widths in samples
                 if rows == r]  # fmt: skip
        samples = [s for s in samples if s[0] != r]
    return jobs + [_sample_compilation(runner, rows, widths) for rows, widths in samples]


def _sample_compilation(runner: ModelRunner, rows: int, widths: tuple[int, int]) -> Compilation:
    """The sample half for ``rows`` padding rows with sampling lists of ``widths``."""
    return Compilation(runner.sample_compiles, runner.jitted_sample,
                       padding_sample_inputs(runner, rows, widths), SAMPLE_ARGS)  # fmt: skip


def _fused_compilations(runner: ModelRunner, what: WarmupSet) -> list[Compilation]:
    """The fused step at each (shape, sampler widths) of ``what`` (the smallest T first)."""
    jobs = []
    for (t, r, b), widths in what.steps:
        forward = padding_forward_inputs(runner, t, r, b)
        *_, draft_ids, sampling_md, last_sampled, sample_slot, draft_q = padding_sample_inputs(
            runner, r, widths
        )
        args = (runner.params, runner.kv_caches, *forward, draft_ids, sampling_md, last_sampled,
                sample_slot, draft_q)  # fmt: skip
        jobs.append(Compilation(runner.fused_compiles, runner.jitted_fused, args, FUSED_ARGS))
    return jobs


def _draft_compilations(runner: ModelRunner) -> list[Compilation]:
    """The draft model's proposal at every row bucket, and its pages' block copies."""
    draft = runner.draft
    jobs = [
        Compilation(
            draft.compiles,
            draft.jitted_propose,
            (draft.params, *draft.propose_args(rows)),
            PROPOSE_ARGS,
        )
        for rows in draft.row_buckets
    ]
    copies = _copy_compilations(draft.copy_compiles, draft.jitted_copy, draft.kv_caches,
                                runner.copy_sizes)  # fmt: skip
    return jobs + copies


def _copy_compilations(compiles, copy_fn, kv_caches, sizes) -> list[Compilation]:
    """A block copy over ``kv_caches`` (the target's or a draft's pages) at every padded size."""
    zeros = lambda n: (np.zeros(n, np.int32),) * 2  # noqa: E731
    return [Compilation(compiles, copy_fn, (kv_caches, *zeros(n)), COPY_ARGS) for n in sizes]


def run_once(runner: ModelRunner, steps: list[Step], copy_sizes: list[int]) -> None:
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
    for (t, r, b), widths in steps:
        batch = PreparedBatch.null_block(t, r, b, runner.block_size)
        runner.run_prepared(batch, neutral_sampling(r, runner.vocab_size, widths))
    for n in copy_sizes:
        runner.copy_blocks(*(np.zeros(n, np.int32),) * 2)
    jax.block_until_ready(runner.kv_caches)


def neutral_sampling(
    padded_rows: int, vocab_size: int, widths: tuple[int, int]
) -> SamplingMetadata:
    """Neutral sampling rows with sampling lists of ``widths`` (penalty, ban)."""
    penalty_width, ban_width = widths
    return SamplingMetadata.neutral(
        padded_rows, vocab_size, penalty_width=penalty_width, ban_width=ban_width
    )


def padding_forward_inputs(
    runner: ModelRunner, padded_tokens: int, padded_rows: int, width: int
) -> tuple[Any, ...]:
    """The forward half's arguments after params and KV pages for an all-padding batch of
    this bucket."""
    batch = PreparedBatch.padding(padded_tokens, padded_rows, width)
    draft_params, draft_kv, _ = DraftModel.step_args(runner.draft, None)
    return (
        batch.input_ids,
        attention_metadata(batch, runner.rope_tables, runner.kv_scales),
        batch.logits_indices,
        np.full(padded_tokens, -1, np.int32),  # no prompt-logprob targets
        TokenFeed(runner.last_sampled, batch.from_slot),
        draft_params,
        draft_kv,
    )


def padding_sample_inputs(
    runner: ModelRunner, padded_rows: int, widths: tuple[int, int]
) -> tuple[Any, ...]:
    """The sample half's arguments for ``padded_rows`` padding rows with sampling lists of
    ``widths``; the forward's results as their shapes (jax.ShapeDtypeStruct), placed as the
    forward places them (jax keys its executables by the arguments' shardings too)."""
    rows = np.full(padded_rows, -1, np.int32)
    placed = None if runner.sharding is None else runner.sharding.replicated
    logits = jax.ShapeDtypeStruct((padded_rows, runner.vocab_size), np.float32, sharding=placed)
    *_, draft_q = DraftModel.step_args(runner.draft, rows)
    return (
        logits,
        jax.ShapeDtypeStruct((padded_rows,), np.int32, sharding=placed),  # pending outputs
        rows,  # no drafts
        neutral_sampling(padded_rows, runner.vocab_size, widths),
        runner.last_sampled,
        np.full(padded_rows, NO_SLOT, np.int32),
        draft_q,
    )
