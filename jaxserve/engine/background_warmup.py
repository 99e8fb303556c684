"""BackgroundWarmup: a server serves while its larger step shapes still compile.

With ``enable_background_warmup`` (AsyncLLM's and ``jaxserve serve``'s default), the engine is
built with the first stage of its warm-up only (runner/warmup_stages.py: the buckets of at most
FIRST_STAGE_TOKENS tokens, compiled and run once at construction) and starts this thread:

    at construction: every later stage's compilations, their arguments abstract (stage_jobs)
    warm-up thread ("jaxserve-warmup"), for each later stage, in increasing token bucket T:
      compile them, no lock held (or load them from the executable store; XLA, no GIL)
      mark the stage ready; it runs once between two engine steps (run_ready: each new step
        once, warmup.run_set, then the scheduler's token cap raised to T: core/sched/step_cap.py)
        in the engine thread at its next step, or here once this thread holds the engine's lock
        (an idle engine); the next stage compiles after that
    then lift the cap: the steps take max_num_batched_tokens again.

    engine thread: EngineCore.step first runs a ready stage (run_ready), then steps as usual;
      each schedule() takes at most the cap's tokens, so every step's shape has compiled and
      run before (a prompt longer than the cap is prefilled in chunks of it): nothing
      compiles on the step path.

``run_once`` donates the KV pages, so it cannot run beside a step: it runs under the engine's
lock, which every step holds (LLMEngine), i.e. between two steps. A step left in flight by
async scheduling is ordered before it by jax (the run takes that step's KV pages as its input),
and the runs write the null block and no sampled-token slot only. The compilations' arguments
are abstract (jax.ShapeDtypeStructs of the arrays' shapes, dtypes and shardings, taken before
the engine serves): the engine thread donates the KV pages and replaces the sampled tokens each
step, and the compiling thread holds none of them.

Stopping (``stop``: LLMEngine.shutdown, AsyncLLM.shutdown) sets a flag checked before each
compilation and between stages, then waits for the thread: it ends once the compilations
already running end (XLA cannot be interrupted); the cap stays where it was. A failure in the
thread is logged and ends the warm-up early: the engine serves on with the cap where it was.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from jaxserve.core.sched.step_cap import StepTokenCap
from jaxserve.runner.warmup import run_set
from jaxserve.runner.warmup_stages import Stage, compile_stage, stage_jobs, warmup_stages

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger("jaxserve")


class WarmupStopped(Exception):
    """Raised inside the warm-up thread to stop it (``BackgroundWarmup.stop``)."""


class BackgroundWarmup:
    """The rest of a server's warm-up, compiled in a thread of its own while it serves.

    Args:
        runner: the engine's runner, warmed up with its first stage (warmup_stages.py).
        lock: the engine's lock, held by every step (LLMEngine's): held, no step runs.
        workers: compilations at a time (the plan's compile_workers).

    ``cap`` is the scheduler's token cap (the first stage's T, None once warm-up has ended or
    when the first stage was the whole set); ``done`` is set when the thread has ended.
    """

    def __init__(self, runner: ModelRunner, lock: Any, workers: int) -> None:
        first, *self._stages = warmup_stages(runner.warmup_set())
        self._runner = runner
        self._lock = lock
        self._workers = workers
        # Each stage's compilations, their arguments abstract: built now, before the engine
        # steps (and donates the arrays they were taken from).
        self._jobs = [stage_jobs(runner, stage) for stage in self._stages]
        self.cap = StepTokenCap(first.tokens if self._stages else None)
        self._ready: Stage | None = None  # compiled, not run yet (run_ready)
        self._ready_lock = threading.Lock()
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxserve-warmup", daemon=True)

    @property
    def stages(self) -> list[Stage]:
        """The stages this thread warms up, in order (the first stage not among them)."""
        return list(self._stages)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> BackgroundWarmup:
        if self._stages:
            logger.info("serving while warm-up goes on: each step takes at most %d tokens "
                        "until %d larger token buckets are ready", self.cap.tokens,
                        len(self._stages))  # fmt: skip
            self._thread.start()
        else:
            self.done.set()
        return self

    def stop(self) -> None:
        """Stop the warm-up and wait for its thread (the compilations running end first).
        A Ctrl-C during the wait stops waiting (the thread is a daemon) and is raised."""
        self._stop.set()
        if not self._thread.is_alive():
            return
        try:
            while not self.done.wait(0.05):
                pass
            self._thread.join()
        except KeyboardInterrupt:
            logger.warning("interrupted while the background warm-up stopped: not waiting")
            raise

    def run_ready(self) -> None:
        """Run each step of the stage compiled last once, if it has not run, and raise the cap
        to its T. Call it with the engine's lock held, between two steps: EngineCore.step does
        first, and the warm-up thread when the engine is idle."""
        with self._ready_lock:
            stage, self._ready = self._ready, None
        if stage is not None:
            run_set(self._runner, stage.what)
            self.cap.raise_to(stage.tokens)
            logger.debug("background warm-up: steps of up to %d tokens ready", stage.tokens)

    def _checks(self) -> None:
        if self._stop.is_set():
            raise WarmupStopped

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            for stage, jobs in zip(self._stages, self._jobs, strict=True):
                self._warm_up(stage, jobs)
            self.cap.lift()
            logger.info("background warm-up done in %.1f s: steps take up to "
                        "max_num_batched_tokens", time.perf_counter() - start)  # fmt: skip
        except WarmupStopped:
            logger.info("background warm-up stopped: steps stay at %s tokens", self.cap.tokens)
        except BaseException:
            logger.exception("background warm-up failed: steps stay at %s tokens",
                             self.cap.tokens)  # fmt: skip
        finally:
            self._jobs = []
            self.done.set()

    def _warm_up(self, stage: Stage, jobs: list) -> None:
        """Compile ``stage``, then wait until it has run once between engine steps (the next
        step runs it, or this thread does once it holds the engine's lock)."""
        compile_stage(jobs, self._workers, self._checks)
        with self._ready_lock:
            self._ready = stage
        while self._ready is not None:
            self._checks()
            if self._lock.acquire(timeout=0.05):
                try:
                    self.run_ready()
                finally:
                    self._lock.release()
