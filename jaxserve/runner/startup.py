"""Start-up: the weights load while warm-up compiles.

Compiling a step needs the weights' shapes, not their values, and the two costs are of
different kinds: reading safetensors or Orbax shards and copying them to the device is I/O and
transfers, tracing, lowering and compiling (or loading from a cache) is CPU work. So a
``StartupPipeline`` runs the load in a thread of its own while the calling thread self-checks
the attention kernel (plan.py: the weights depend on the dtype and the shardings, not on the
kernel), builds the ModelRunner over abstract weights (abstract_weights.py:
jax.ShapeDtypeStructs in their shardings), gives it its executable store and, for a server
(``warmup=True``), compiles the whole warm-up set, smallest shapes first (for a job handed to
the construction, the set its requests can reach: job_startup.py). Then it waits for
the weights, puts them in the runner, and only then runs each step once (warmup.run_once
needs real weights):

    calling thread | kernel check | runner | store | compile / load executables | wait | run once |
    load thread    | read + place weights ....... |

The steps jax compiled for the abstract weights are the ones the loaded weights call: the same
shapes, dtypes and shardings, checked leaf by leaf (abstract_weights.mismatch) before they are
used; a checkpoint that differs (nothing known does) is logged and its runner built again from
the loaded weights, compiled as before. Where the runner itself needs the weights' values to be
built (an FP8 KV cache whose scales may come from a calibration pass), where only
config.json is here yet (a Hub model), or for an Orbax checkpoint on a mesh over several
processes (its restore synchronises the processes, and their cross-process computations must
come in the same order in every process, which two threads would not keep; the other loads
issue none: checkpoint.place), the load comes first (factory._weights_first).

Failures: an error in the load thread stops the compilations at the next one (the error is
raised in the calling thread, as the sequential load raised it); an error in the calling
thread waits for the load to end before it propagates, so no thread outlives the call. A
Ctrl-C while the calling thread waits for the load (either wait) stops waiting at once: the
load thread, a daemon that cannot hold the process, ends on its own and its result is
dropped. ``events``, in order, is a test hook: ("load", "start" / "end"), ("resolve", "end"),
("compile", "start" / "end"), ("weights", "attached").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from jaxserve.runner.abstract_weights import mismatch

logger = logging.getLogger("jaxserve")

T = TypeVar("T")


class BackgroundCall(Generic[T]):
    """``fn()`` run in a daemon thread of its own: ``result()`` waits for it (a Ctrl-C
    interrupts the wait) and raises its exception; ``raise_if_failed()`` raises it without
    waiting, once it has failed."""

    def __init__(self, fn: Callable[[], T], name: str) -> None:
        self._fn = fn
        self._result: T | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> BackgroundCall[T]:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as e:  # raised in the waiting thread, never lost
            self._error = e
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def raise_if_failed(self) -> None:
        """Raise the call's exception if it has failed already."""
        if self._done.is_set() and self._error is not None:
            raise self._error

    def wait(self) -> None:
        """Wait for the call to end (in short waits: Ctrl-C reaches the main thread)."""
        while not self._done.wait(0.05):
            pass
        self._thread.join()

    def result(self) -> T:
        """The call's result, once it ends; its exception, raised here, if it failed."""
        self.wait()
        if self._error is not None:
            raise self._error
        return self._result


class StartupPipeline:
    """Loads the weights in a thread while the calling thread resolves, builds and compiles.

    Args:
        load: reads the checkpoint (factory._load_weights): runs in the load thread.
        resolve: () -> the model resolved with its attention kernel self-checked (the
            weights do not depend on the kernel), in the calling thread while they load.
        abstract: (resolved) -> the checkpoint with abstract weights
            (abstract_weights.abstract_checkpoint).
        make_runner: (resolved, checkpoint) -> (runner, host tier), the runner given its
            executable store (factory: make_runner, then use_executable_store).
        compile_all: None (the warm-up is per job, or never), else (runner, checks, ckpt) ->
            compiles the warm-up set of the runner built from ``ckpt`` (a server's, or a
            handed job's: job_startup.py, which tokenizes with ``ckpt.tokenizer``), calling
            ``checks()`` before each compilation (it raises the load's error once the load has
            failed).
        run_once: None, else (runner) -> runs each warmed-up step once, on the loaded
            weights (warmup.ServerWarmup.run).
    """

    def __init__(
        self,
        load: Callable[[], Any],
        resolve: Callable[[], Any],
        abstract: Callable[[Any], Any],
        make_runner: Callable[[Any, Any], tuple[Any, Any]],
        compile_all: Callable[[Any, Callable[[], None], Any], None] | None = None,
        run_once: Callable[[Any], None] | None = None,
    ) -> None:
        self._load = load
        self._resolve = resolve
        self._abstract = abstract
        self._make_runner = make_runner
        self._compile_all = compile_all
        self._run_once = run_once
        self.events: list[tuple[str, str]] = []  # the test hook (module docstring)
        self._lock = threading.Lock()

    def _event(self, what: str, when: str) -> None:
        with self._lock:
            self.events.append((what, when))

    def _timed_load(self) -> Any:
        self._event("load", "start")
        try:
            return self._load()
        finally:
            self._event("load", "end")

    def run(self) -> tuple[Any, Any, Any, Any]:
        """(runner, host tier, loaded checkpoint, resolved model): the runner holds the
        loaded weights and, with a server's warm-up, every executable of its set, each run
        once.

        Raises:
            what the load raises (first, once it has failed), else what resolving, building
            or compiling raises.
        """
        load = BackgroundCall(self._timed_load, "jaxserve-weights").start()
        try:
            resolved = self._resolve()
            self._event("resolve", "end")
            abstract = self._abstract(resolved)
            runner, host_tier = self._make_runner(resolved, abstract)
            if self._compile_all is not None:
                self._event("compile", "start")
                self._compile_all(runner, load.raise_if_failed, abstract)
                self._event("compile", "end")
        except BaseException:
            self._stop(load)
            raise
        ckpt = load.result()
        differs = mismatch(abstract, ckpt)
        if differs is not None:
            logger.warning(
                "the loaded checkpoint is not the one its config.json describes (%s): building "
                "the runner again from the loaded weights",
                differs,
            )
            runner = host_tier = None  # its KV pages freed before the new runner's
            runner, host_tier = self._make_runner(resolved, ckpt)
            if self._compile_all is not None:
                self._compile_all(runner, lambda: None, ckpt)
        runner.params = ckpt.params
        self._event("weights", "attached")
        if self._run_once is not None:
            self._run_once(runner)
        return runner, host_tier, ckpt, resolved

    def _stop(self, load: BackgroundCall) -> None:
        """The calling thread failed: wait for the load to end (its result or error dropped:
        the calling thread's error is the one raised), so no thread outlives the call."""
        try:
            load.wait()
        except KeyboardInterrupt:  # stop waiting; the daemon thread cannot hold the process
            logger.warning("interrupted while the weights loaded: not waiting for the load")


def checked(jobs: Iterable[T], checks: Callable[[], None]) -> Iterator[T]:
    """``jobs``, calling ``checks()`` before each one (it raises to stop them)."""
    for job in jobs:
        checks()
        yield job
