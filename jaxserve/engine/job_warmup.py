"""Job-sized warm-up of an LLM's engine (``warmup="job"``, LLM's default): before a job's
requests are queued, compile and run once the step shapes they can reach (runner/job_shapes.py)
together with the requests still unfinished in the engine (another stream's: their steps may
batch with these). What an earlier job warmed up stays; only what is new compiles: a job
handed to the engine's construction (job_preview.py) had its set compiled then, while the
weights loaded, and finds nothing new here. A server
(LLMEngine, AsyncLLM: ``warmup=True``) compiles the full set when it is built instead."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxserve.config import EngineConfig
from jaxserve.runner.job_shapes import JobRequest, WarmupSet, job_request, job_warmup_set

if TYPE_CHECKING:
    from jaxserve.engine.llm_engine import CheckedRequest, LLMEngine
    from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger("jaxserve")


def warm_up_for(engine: LLMEngine, requests: Sequence[CheckedRequest]) -> int:
    """Warm ``engine`` up for ``requests`` when its warm-up is per job; call with the
    engine's lock held (LLMEngine.exclusive), before queueing them.

    Returns:
        The compilations this caused (fresh or loaded from the cache); 0 when the engine's
        warm-up is not per job, or nothing is new.
    """
    config = engine.config
    if config.runner.warmup != "job" or not requests:
        return 0
    runner = engine.runner
    jobs = [job_request(len(r.token_ids), r.params, r.constraints is not None) for r in requests]
    what = job_set(config, runner, jobs + _unfinished(engine))
    start = time.perf_counter()
    num = runner.warmup(workers=engine.info.plan.compile_workers, what=what)
    if num:
        logger.info(
            "warm-up for %d requests: %d shapes (of %d) x %d sampler variants, %d block copies: "
            "%d compilations in %.1f s",
            len(requests),
            len(what.shapes),
            len(runner.buckets.all_shapes()),
            len(what.variants),
            len(what.copy_sizes),
            num,
            time.perf_counter() - start,
        )
    return num


def job_set(config: EngineConfig, runner: ModelRunner, jobs: Sequence[JobRequest]) -> WarmupSet:
    """The set ``jobs`` can reach on ``runner`` under the resolved ``config`` (its limits, its
    KV pool, its speculative drafts): what a job's warm-up compiles, here or at the engine's
    construction (job_preview.py)."""
    spec = config.speculative
    return job_warmup_set(
        jobs,
        runner.buckets,
        block_size=config.cache.block_size,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_model_len=config.model.max_model_len,
        variant_widths=runner.sampling.variant_widths,
        copy_sizes=runner.copy_sizes,
        num_spec_tokens=0 if spec is None else spec.num_speculative_tokens,
        num_usable_blocks=config.cache.num_kv_blocks - 1,  # the null block is never allocated
    )


def _unfinished(engine: LLMEngine) -> list[JobRequest]:
    """The engine's unfinished requests, as a job's (the sampler's list variant assumed:
    their constraints are not kept)."""
    return [
        JobRequest(num_prompt_tokens, params.max_tokens, params.n, needs_lists=True)
        for num_prompt_tokens, params in engine.unfinished_requests()
    ]
