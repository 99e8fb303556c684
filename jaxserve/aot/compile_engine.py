"""compile_engine: every compilation warm-up would run on the target, compiled here.

build_abstract_engine(config, target)      the runner the engine would build there
warmup.compilations(runner, what)          its step buckets x sampler variants, block copies,
                                           the host KV tier's copies, a draft model's jobs
compiler.compile_job(job, mesh)            each one, for the target's compile-only devices
ExecutableStore.create(output, fields)     with output: each executable serialized, for
                                           LLM(precompiled=output) on the target
CompileReport                              per bucket, totals, roofline predictions
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

from jaxserve.aot.abstract_engine import AbstractEngine, build_abstract_engine
from jaxserve.aot.compiler import BucketResult, compile_job
from jaxserve.aot.report import CompileReport
from jaxserve.aot.roofline import StepModel
from jaxserve.aot.targets import AcceleratorTarget
from jaxserve.config import EngineConfig
from jaxserve.runner.compile_cache import CompileEvents
from jaxserve.runner.executable_store import ExecutableStore, fields_of
from jaxserve.runner.step_compiles import signature
from jaxserve.runner.warmup import compilations

logger = logging.getLogger("jaxserve")

DEFAULT_DECODE_CONTEXT = 1024  # tokens of context of the decode prediction


def compile_engine(
    config: EngineConfig,
    target: AcceleratorTarget,
    *,
    token_buckets: Sequence[int] | None = None,
    decode_context: int = DEFAULT_DECODE_CONTEXT,
    on_result: Callable[[BucketResult], None] | None = None,
    output: str | None = None,
    on_start: Callable[[str], None] | None = None,
) -> CompileReport:
    """Compile the engine of ``config`` for ``target`` (no weights, no device) and report.

    Args:
        token_buckets: only the step buckets of these token counts (T), each one of the
            engine's; None: all of them. The block copies are always compiled.
        decode_context: the context length (tokens) of the decode prediction.
        on_result: called with each compilation's result as it finishes (progress).
        on_start: called with each compilation's label before it starts (compiler.compile_job).
        output: a folder to write the executables to (runner/executable_store.py's format,
            keyed by the engine's fields on the target), for LLM(precompiled=output) there.

    Raises:
        ValueError: a token bucket the engine does not have, a decode_context < 1, or what
            build_abstract_engine refuses.
        devices.CompilerMissing: the target's compiler is not installed.
    """
    if decode_context < 1:
        raise ValueError(f"decode_context must be >= 1, got {decode_context}")
    engine = build_abstract_engine(config, target)
    shapes = _shapes(engine, token_buckets)
    mesh = engine.resolved.sharding.mesh
    draft = engine.runner.draft
    draft_counters = () if draft is None else (draft.compiles, draft.copy_compiles)
    results = []
    store = None
    if output is not None:
        store = ExecutableStore.create(output, fields_of(engine.resolved, engine.arch))
    for job in compilations(engine.runner, engine.runner.warmup_set(shapes)):
        keep = None if store is None else _saver(store, job)
        is_draft = any(job.compiles is c for c in draft_counters)
        with nullcontext() if store is None else store.fresh_compiles():
            result = compile_job(job, mesh, draft=is_draft, on_compiled=keep, on_start=on_start)
        results.append(result)
        if on_result is not None:
            on_result(result)
    plan = engine.resolved.plan
    return CompileReport(
        model=config.model.model,
        target=target,
        plan=plan.as_dict(),
        memory=engine.resolved.memory,
        buckets=results,
        step_model=_step_model(engine),
        decode_context=min(decode_context, engine.resolved.config.model.max_model_len),
    )


def _saver(store: ExecutableStore, job: Any) -> Callable[[Any], None]:
    """What keeps ``job``'s compiled executable in ``store``: not one jax loaded from its
    persistent cache (in this thread, since now), which would serialize without its code
    (ExecutableStore.save)."""
    sig = signature(job.args, job.names, {})
    before = CompileEvents.in_thread()

    def keep(compiled: Any) -> None:
        loaded = CompileEvents.in_thread().since(before).cache_hits > 0
        store.save(job.compiles.name, sig, compiled, from_cache=loaded)

    return keep


def _shapes(
    engine: AbstractEngine, token_buckets: Sequence[int] | None
) -> list[tuple[int, int, int]]:
    """The runner's (T, R, B) shapes, only those of ``token_buckets`` when given."""
    shapes = engine.runner.buckets.all_shapes()
    if token_buckets is None:
        return shapes
    known = engine.runner.buckets.token_buckets
    unknown = sorted(set(token_buckets) - set(known))
    if unknown:
        raise ValueError(
            f"--token-buckets {unknown} are not token buckets of this engine; they are "
            f"{list(known)} (max_num_batched_tokens sets the largest)"
        )
    return [s for s in shapes if s[0] in set(token_buckets)]


def _step_model(engine: AbstractEngine) -> StepModel:
    """Per-device figures of the roofline from the memory plan and the architecture."""
    memory, arch = engine.resolved.memory, engine.arch
    tp = engine.resolved.plan.tensor_parallel_size
    heads = arch.num_heads // tp if arch.num_heads % tp == 0 else arch.num_heads
    return StepModel(
        weights_bytes=memory.weights_bytes,
        kv_bytes_per_token=memory.kv_bytes_per_token,
        attention_flops_per_context=4.0 * heads * arch.head_dim * arch.num_layers,
    )
