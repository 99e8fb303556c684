"""A job's warm-up at construction: the shapes of a job handed to the engine compile while
the weights load.

An offline job warms up only the shapes its requests can reach (job_shapes.py), and it cannot
know them before its prompts are tokenized. When the job's requests are known before the
engine is built (the `generate` and `score` commands read their input first; any caller may
hand them: engine/job_preview.py), the engine's construction computes the job's WarmupSet from
the runner it built over abstract weights and the checkpoint's tokenizer (both there before the
weights are: abstract_weights.py), and compiles it in the calling thread while the load thread
reads the weights (startup.py), as a server's warm-up is compiled; each step then runs once on
the loaded weights. The job's own warm-up, when it starts (engine/job_warmup.py), computes its
set again from the checked requests: it finds everything compiled and run, and compiles only
what the handed set missed (a request the preview could not read, a shape it did not foresee),
before the job's first step as before. So the handed set is a head start, never a promise:
nothing compiles on the step path either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxserve.checkpoints_tools import LoadedCheckpoint, TokenizerInfo
from jaxserve.config import EngineConfig
from jaxserve.runner.job_shapes import WarmupSet
from jaxserve.runner.warmup import compile_set, run_set

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger("jaxserve")

# (the runner built over abstract weights, the resolved config, the checkpoint's tokenizer) ->
# the handed job's set, or None when none of its requests could be read.
JobSetFn = Callable[["ModelRunner", EngineConfig, TokenizerInfo], WarmupSet | None]


class JobStartupWarmup:
    """A handed job's warm-up in the two halves of ServerWarmup (startup.StartupPipeline's
    compile_all and run_once): ``compile`` computes the set (``job_set``) and compiles it
    over the runner's shapes, ``run`` runs each step once on the loaded weights.

    Args:
        job_set: the handed job's set (JobSetFn).
        config: the resolved engine config (what job_set bounds shapes with).
        workers: compilations at a time.
    """

    def __init__(self, job_set: JobSetFn, config: EngineConfig, workers: int) -> None:
        self._job_set = job_set
        self._config = config
        self.workers = workers
        self.what: WarmupSet | None = None  # the set compile() computed; None: nothing to do
        self._start: float | None = None

    def compile(
        self, runner: ModelRunner, checks: Callable[[], None] | None, ckpt: LoadedCheckpoint
    ) -> None:
        """Compute the job's set for ``runner`` with ``ckpt``'s tokenizer (the checkpoint the
        runner was built from) and compile it, calling ``checks()`` before each compilation."""
        self._start = self._start or time.perf_counter()
        self.what = self._job_set(runner, self._config, ckpt.tokenizer)
        if self.what is not None:
            compile_set(runner, self.what, self.workers, checks)

    def run(self, runner: ModelRunner) -> None:
        """Run each step of the set once on the loaded weights, and log what it cost."""
        if self.what is None:
            logger.info("warm-up at construction: the handed job has no request it can read")
            return
        run_set(runner, self.what)
        logger.info(
            "warm-up for the handed job at construction: %d shapes (of %d) x %d sampler "
            "variants, %d block copies: %d compilations (%d loaded from the compilation cache) "
            "in %.1f s, while the weights loaded",
            len(self.what.shapes),
            len(runner.buckets.all_shapes()),
            len(self.what.variants),
            len(self.what.copy_sizes),
            runner.num_compilations + runner.num_compilation_cache_hits,
            runner.num_compilation_cache_hits,
            time.perf_counter() - (self._start or time.perf_counter()),
        )
