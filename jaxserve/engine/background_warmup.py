"""BackgroundWarmup: a server serves while its larger step shapes still compile.

With ``enable_background_warmup`` (AsyncLLM's and ``jaxserve serve``'s default), the engine is
built with the first stage of its warm-up only (runner/warmup_stages.py: the buckets of at most
FIRST_STAGE_TOKENS tokens, compiled and run once at construction) and starts this thread:

    warm-up thread ("jaxserve-warmup"), for each later stage, in increasing token bucket T:
      between steps:  the stage's compilations, with abstract arguments    (engine lock held)
      no lock:        compile them (or load them from the executable store; XLA, no GIL)
      between steps:  run each new step once (warmup.run_set)             (engine lock held)
      then:           raise the scheduler's token cap to T   (core/sched/step_cap.py)
    then lift the cap: the steps take max_num_batched_tokens again.

    engine thread: steps as usual; each schedule() takes at most the cap's tokens, so every
      step's shape has compiled and run before (a prompt longer than the cap is prefilled in
      chunks of it): nothing compiles on the step path.

``run_once`` donates the KV pages, so it cannot run beside a step: it runs under the engine's
lock, which every step holds (LLMEngine), i.e. between two steps. A step left in flight by
async scheduling is ordered before it by jax (the run takes that step's KV pages as its input),
and the runs write the null block and no sampled-token slot only.

Stopping (``stop``: LLMEngine.shutdown, AsyncLLM.shutdown) sets a flag checked before each
compilation and between stages, then waits for the thread: it ends once the compilations
already running end (XLA cannot be interrupted); the cap stays where it was. A failure in the
thread is logged and ends the warm-up early: the engine serves on with the cap where it was.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

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
        between_steps: () -> a context manager held while no step runs (the engine's lock).
        workers: compilations at a time (the plan's compile_workers).

    ``cap`` is the scheduler's token cap (the first stage's T, None once warm-up has ended or
    when the first stage was the whole set); ``done`` is set when the thread has ended.
    """

    def __init__(
        self,
        runner: ModelRunner,
        between_steps: Callable[[], AbstractContextManager],
        workers: int,
    ) -> None:
        first, *self._stages = warmup_stages(runner.warmup_set())
        self._runner = runner
        self._between_steps = between_steps
        self._workers = workers
        self.cap = StepTokenCap(first.tokens if self._stages else None)
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

    def _checks(self) -> None:
        if self._stop.is_set():
            raise WarmupStopped

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            for stage in self._stages:
                self._warm_up(stage)
            self.cap.lift()
            logger.info("background warm-up done in %.1f s: steps take up to "
                        "max_num_batched_tokens", time.perf_counter() - start)  # fmt: skip
        except WarmupStopped:
            logger.info("background warm-up stopped: steps stay at %s tokens", self.cap.tokens)
        except BaseException:
            logger.exception("background warm-up failed: steps stay at %s tokens",
                             self.cap.tokens)  # fmt: skip
        finally:
            self.done.set()

    def _warm_up(self, stage: Stage) -> None:
        """Compile ``stage``, run its steps once between engine steps, raise the cap."""
        self._checks()
        with self._between_steps():
            jobs = stage_jobs(self._runner, stage)
        compile_stage(jobs, self._workers, self._checks)
        self._checks()
        with self._between_steps():
            run_set(self._runner, stage.what)
        self.cap.raise_to(stage.tokens)
        logger.debug("background warm-up: steps of up to %d tokens ready", stage.tokens)
