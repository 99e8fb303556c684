"""A server's warm-up in stages: the smallest token buckets before it serves, the rest after.

The server's warm-up set (ModelRunner.warmup_set: every bucket) is cut by token bucket T into
stages, in increasing T: the first stage holds every shape of at most FIRST_STAGE_TOKENS tokens
(and, through warmup.compilations, the host tier's and the KV connector's copies and a draft
model's functions: each compiles once, whichever stage lists it first); each later stage one
larger T, at every block-table width, with the sample half of its row bucket in every sampler
variant; each stage the block copies a step of its T can need. Once a stage has compiled and
run, every step of at most its T tokens runs a compiled executable: rows are at most tokens
(buckets.py), and every width and variant of a bucket is in its stage. So a step whose tokens
are capped at the largest ready T (core/sched/step_cap.py) compiles nothing.

The first stage compiles at construction, as the whole set did (startup.py); the others
compile in engine/background_warmup.py's thread while the engine serves, through
``compile_stage`` (no warm-up flag is touched: a compilation on the step path meanwhile is
still explained, step_compiles.py), and run once between engine steps (warmup.run_set).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax

from jaxserve.runner.job_shapes import WarmupSet
from jaxserve.runner.step_compiles import Compilation
from jaxserve.runner.warmup import compilations, compile_jobs, split_stored

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import ModelRunner

# The first stage: every shape of at most this many tokens. A prompt longer than this is
# prefilled in chunks of it until larger buckets are ready, and at most this many requests
# decode in one step. 8 keeps the first stage to the smallest buckets (on the CPU: T = 1, 4,
# 6, 8, with the sample halves of their row buckets) while a short chat prompt still takes a
# few steps (docs/benchmarks.md, "Serving before warm-up ends").
FIRST_STAGE_TOKENS = 8


@dataclass(frozen=True)
class Stage:
    """Part of a server's warm-up set: once compiled and run, every step of at most
    ``tokens`` tokens is ready."""

    tokens: int  # the largest token bucket of the stage
    what: WarmupSet


def warmup_stages(what: WarmupSet, first_tokens: int = FIRST_STAGE_TOKENS) -> list[Stage]:
    """``what`` cut into stages by token bucket (module docstring), in increasing T; the first
    holds the shapes of at most ``first_tokens`` tokens (at least the smallest bucket's), each
    later one a single larger T. A step copies at most one block per request and has at most
    T requests, so a stage's block copies are the sizes up to T rounded up to a power of two
    that no earlier stage holds (the largest stage takes any left)."""
    buckets = sorted({t for t, _, _ in what.shapes})
    first = max([t for t in buckets if t <= first_tokens] or buckets[:1])
    groups = [[t for t in buckets if t <= first]] + [[t] for t in buckets if t > first]
    stages, copies_left = [], sorted(what.copy_sizes)
    for i, ts in enumerate(groups):
        shapes = tuple(s for s in what.shapes if s[0] in ts)
        last = i == len(groups) - 1
        reach = 1 << (max(ts) - 1).bit_length()  # T rounded up to a power of two
        copies = tuple(n for n in copies_left if n <= reach or last)
        copies_left = [n for n in copies_left if n not in copies]
        stages.append(Stage(max(ts), WarmupSet(shapes, what.variants, copies)))
    return stages


def first_stage(what: WarmupSet) -> WarmupSet:
    """The part of ``what`` a server warms up before it serves (ServerWarmup's select)."""
    return warmup_stages(what)[0].what


def stage_jobs(runner: ModelRunner, stage: Stage) -> list[Compilation]:
    """The compilations of ``stage`` with abstract arguments: each jax.Array (the params, the
    KV pages, the last sampled tokens) as a jax.ShapeDtypeStruct of its shape, dtype and,
    when committed, sharding. The engine thread replaces the KV pages and sampled tokens each
    step and donates the old arrays, so the compiling thread must not hold them; jax keys its
    executables by exactly these, so the engine's calls run what compiles here. Call it
    between engine steps."""
    return [
        Compilation(job.compiles, job.fn, jax.tree_util.tree_map(_abstract, job.args), job.names)
        for job in compilations(runner, stage.what)
    ]


def compile_stage(
    jobs: list[Compilation], workers: int, checks: Callable[[], None] | None = None
) -> None:
    """Compile (or load from the executable store) ``jobs`` (stage_jobs), ``workers`` at a
    time, calling ``checks()`` before each (it raises to stop them); what compiled before is
    skipped (StepCompiles.lower)."""
    stored, rest = split_stored(jobs)
    compile_jobs(stored, rest, workers, checks)


def _abstract(x: Any) -> Any:
    if not isinstance(x, jax.Array):
        return x
    sharding = x.sharding if x.committed else None
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
