"""Compilations of the runner's jitted step: counted (fresh, or loaded from the persistent
cache) and, once warm-up is done, explained.

A compilation after warm-up costs seconds (minutes on TPU) in the middle of serving, so each one
logs a warning that names the function, each argument field (a pytree leaf, e.g.
``sampling_metadata.penalty_token_ids``) whose shape, dtype or static value differs from the
closest earlier compilation, with its old and new value, and what to do; each is kept in
``events`` (get_stats()["recompilations"]: "new" maps a field to its new value, "old" to the
value it had in that closest compilation, absent when it is new).

Warm-up compiles ahead of time (``compile_concurrently``): each call is lowered (traced, in the
calling thread: Python, under the GIL) and compiled or loaded from the persistent cache in a
thread pool (XLA does both without holding the GIL), so the next call is traced while the
earlier ones compile. jax keeps each executable, so the later call with the same arguments
runs it without tracing again.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxserve.runner.compile_cache import CompileEvents
from jaxserve.runner.executable_store import ExecutableStore

logger = logging.getLogger("jaxserve")

Signature = dict[str, str]  # argument field -> its dtype[shape], or its static value


class StepCompiles:
    """Runs a jitted function and keeps track of its compilations (counted from jax's
    compilation events in the calling thread: compile_cache.CompileEvents).

    With an executable store (executable_store.py, given by use_store), warm-up loads each
    executable the store holds instead of tracing, lowering and compiling it, and saves each
    one it compiles; a call whose arguments have the shapes of a loaded executable runs it.

    Args:
        name: the function's name, for messages.
        fixed_args: how many leading arguments keep their shapes for the runner's life (params
            and KV pages): the shapes of the others pick a loaded executable.
    """

    def __init__(self, name: str, fixed_args: int = 0) -> None:
        self.name = name
        self.store: ExecutableStore | None = None  # serialized executables (use_store)
        self._fixed_args = fixed_args
        self._loaded: dict[tuple, Any] = {}  # dispatch key -> executable loaded from the store
        self.num_fresh = 0  # compiled here
        self.num_cache_hits = 0  # loaded from the persistent compilation cache
        self.warmed_up = False  # set when the runner's warm-up is done (finish_warmup)
        self.events: list[dict[str, Any]] = []  # compilations after warm-up, explained
        self._seen: list[Signature] = []
        self._pending: list[Signature] = []  # lowered ahead of time, not compiled yet
        self._lock = threading.Lock()  # lowered in one thread, compiled in others
        self._unsaved: list[tuple[Signature, Any, bool]] = []  # not yet run (save_ran)

    def use_store(self, store: ExecutableStore | None) -> None:
        """Warm-up loads what ``store`` holds instead of compiling it, and saves there what it
        compiles (None: no store)."""
        self.store = store

    def __call__(
        self, fn: Callable[..., Any], args: Sequence[Any], names: Sequence[str], **static: Any
    ) -> Any:
        """``fn(*args, **static)``; ``names`` name the positional args (for explanations)."""
        if self._loaded and not static:
            key = self._dispatch_key(args)
            executable = self._loaded.get(key)
            if executable is not None:
                try:
                    return executable(*args)
                except TypeError as e:  # jax's argument check, before anything runs
                    del self._loaded[key]
                    logger.warning("%s: a loaded executable refused its arguments (%s); "
                                   "compiling instead", self.name, e)  # fmt: skip
        before = CompileEvents.in_thread()
        out = fn(*args, **static)
        new = CompileEvents.in_thread().since(before)
        if new.compilations:
            self._compiled(signature(args, names, static), new.cache_hits > 0)
        return out

    def save_after_run(self, sig: Signature, compiled: Any, from_cache: bool = False) -> None:
        """Keep a compiled executable for the store until it has run (save_ran): only what
        warm-up ran is kept. ``from_cache``: XLA did not compile it here (jax loaded it from its
        persistent cache or had it in memory), so the store does not save it on the CPU
        (ExecutableStore.save)."""
        self._unsaved.append((sig, compiled, from_cache))

    def save_ran(self, ran: bool = True) -> None:
        """Save the executables kept by save_after_run to the store once warm-up ran them
        (``ran``); drop them otherwise (they are compiled again next time)."""
        unsaved, self._unsaved = self._unsaved, []
        if ran and self.store is not None:
            for sig, compiled, from_cache in unsaved:
                self.store.save(self.name, sig, compiled, from_cache)

    def begin_warmup(self) -> None:
        """A warm-up starts (the first, or a job's, job_shapes.py): its compilations are
        expected, neither explained nor logged."""
        self.warmed_up = False

    def finish_warmup(self) -> None:
        """Warm-up is done: every later compilation is explained (and logged)."""
        self.warmed_up = True

    def precompile(self, fn: Any, args: Sequence[Any], names: Sequence[str]) -> None:
        """Lower and compile the jitted ``fn`` for ``args`` without running it (thread-safe);
        a later ``self(fn, args, names)`` then runs the compiled executable. Nothing is done
        for arguments compiled (or lowered to be compiled) before."""
        lowered = self.lower(fn, args, names)
        if lowered is not None:
            lowered.compile()

    def lower(self, fn: Any, args: Sequence[Any], names: Sequence[str]) -> Lowered | None:
        """The first half of ``precompile``: trace and lower the jitted ``fn`` for ``args``;
        the returned ``Lowered.compile()`` (in any thread) compiles it and counts the
        compilation. None for arguments compiled, or lowered to be compiled, before."""
        sig = signature(args, names, {})
        with self._lock:
            if sig in self._seen or sig in self._pending:
                return None
            self._pending.append(sig)
        if self.store is not None and self.store.has(self.name, sig):
            return Lowered(self, sig, None, 0, (fn, args))  # loaded by compile()
        try:
            before = CompileEvents.in_thread()
            lowered = fn.lower(*args)
            hits = CompileEvents.in_thread().since(before).cache_hits
        except BaseException:
            self._discard(sig)
            raise
        return Lowered(self, sig, lowered, hits, (fn, args))

    def _dispatch_key(self, args: Sequence[Any]) -> tuple:
        """The shapes and dtypes of the arguments after the fixed ones: which loaded
        executable a call runs (jax checks every argument when it does)."""
        leaves = jax.tree_util.tree_leaves(args[self._fixed_args :])
        return tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves)

    def _loaded_from_store(self, sig: Signature, args: Sequence[Any], executable: Any) -> None:
        with self._lock:
            self._loaded[self._dispatch_key(args)] = executable
            self._pending.remove(sig)
            self._record(sig, from_cache=True, ahead_of_time=True)

    def _discard(self, sig: Signature) -> None:
        with self._lock:
            self._pending.remove(sig)

    def _compiled(self, sig: Signature, from_cache: bool, ahead_of_time: bool = False) -> None:
        with self._lock:
            if sig in self._pending:
                self._pending.remove(sig)
            self._record(sig, from_cache, ahead_of_time)

    def _record(self, sig: Signature, from_cache: bool, ahead_of_time: bool = False) -> None:
        """Count a compilation; one after warm-up is explained unless it was compiled ahead of
        time (``precompile``: a warm-up's, such as a server's background warm-up, which goes
        on after the engine started serving: engine/background_warmup.py)."""
        if from_cache:
            self.num_cache_hits += 1
        else:
            self.num_fresh += 1
        if self.warmed_up and not ahead_of_time:
            new, old = explain(sig, self._seen)
            self.events.append(
                {"function": self.name, "new": new, "old": old, "from_cache": from_cache}
            )
            logger.warning(
                "%s compiled after warm-up%s: %s. Warm-up did not compile this shape: with "
                "warmup=False the first call of each shape compiles; otherwise this is a bug in "
                "warm-up's coverage, please report it with this message",
                self.name,
                " (loaded from the compilation cache)" if from_cache else "",
                describe(new, old),
            )
        self._seen.append(sig)


@dataclass(frozen=True)
class Compilation:
    """One call to compile ahead of time: ``compiles.precompile(fn, args, names)``."""

    compiles: StepCompiles
    fn: Any  # a jax.jit-wrapped function
    args: tuple[Any, ...]
    names: tuple[str, ...]


@dataclass
class Lowered:
    """A call lowered ahead of time (``StepCompiles.lower``), to be compiled once; or, where
    the executable store holds it, to be loaded (``lowered`` None)."""

    compiles: StepCompiles
    sig: Signature
    lowered: Any  # jax.stages.Lowered; None: load it from the store
    cache_hits: int  # cache loads while lowering (in the lowering thread)
    call: tuple[Any, Sequence[Any]]  # (the jitted function, its arguments)

    def compile(self) -> None:
        """Load from the executable store, or compile (or load from the persistent cache) in
        the calling thread, and count it from this thread's compilation events; a compiled
        executable is saved to the store."""
        compiles = self.compiles
        try:
            if self.lowered is None:
                fn, args = self.call
                executable = compiles.store.load(compiles.name, self.sig)
                if executable is not None:
                    compiles._loaded_from_store(self.sig, args, executable)
                    return
                self.lowered = fn.lower(*args)  # a failed load: compile it after all
            before = CompileEvents.in_thread()
            with nullcontext() if compiles.store is None else compiles.store.fresh_compiles():
                compiled = self.lowered.compile()
            events = CompileEvents.in_thread().since(before)
            loaded = events.cache_hits  # from jax's persistent cache
            hits = self.cache_hits + loaded
            # XLA compiled it here only if some compilation event was not a cache load: with
            # none at all, jax's in-memory cache handed back an executable this process already
            # had (another engine of the same shapes), perhaps one loaded from the persistent
            # cache, which on the CPU serializes without its object code.
            compiled_here = events.compilations > events.cache_hits
        except BaseException:
            self.discard()
            raise
        self.lowered = self.call = None  # the StableHLO module is no longer needed
        if compiles.store is not None:
            compiles.save_after_run(self.sig, compiled, from_cache=not compiled_here)
        compiles._compiled(self.sig, hits > 0, ahead_of_time=True)

    def discard(self) -> None:
        """Forget a lowered call that will not be compiled (failed, or cancelled)."""
        self.compiles._discard(self.sig)


def compile_concurrently(jobs: Sequence[Compilation], workers: int) -> None:
    """Compile every job, ``workers`` compilations at a time: this thread traces and lowers
    the jobs in turn (Python, under the GIL) while a pool of ``workers`` threads compiles the
    lowered ones or loads them from the persistent cache (XLA, without the GIL), at most
    ``2 * workers`` lowered jobs waiting. With ``workers <= 1`` everything runs in this thread.
    The first failure (or an interrupt) cancels the jobs not yet started and is raised once
    the running ones are done: no thread outlives the call."""
    if workers <= 1:  # in this thread: plain tracebacks, nothing to wait for
        for job in jobs:
            job.compiles.precompile(job.fn, job.args, job.names)
        return
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jaxserve-compile")
    in_flight: deque[tuple[Future, Lowered]] = deque()
    try:
        for job in jobs:
            # Collect finished compilations in job order (a failure is raised here, and stops
            # the lowering), and wait while 2 * workers are in flight.
            while in_flight and (in_flight[0][0].done() or len(in_flight) >= 2 * workers):
                in_flight.popleft()[0].result()
            lowered = job.compiles.lower(job.fn, job.args, job.names)
            if lowered is not None:
                in_flight.append((pool.submit(lowered.compile), lowered))
        while in_flight:
            in_flight.popleft()[0].result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for future, lowered in in_flight:
            if future.cancelled():
                lowered.discard()


def signature(args: Sequence[Any], names: Sequence[str], static: dict[str, Any]) -> Signature:
    """Each leaf of each argument, keyed by the argument's name and the leaf's pytree path
    (``sampling_metadata.top_k``, ``kv_caches[0][1]``), as dtype[shape]; static values as
    their repr."""
    sig = {}
    for name, arg in zip(names, args, strict=True):
        for path, x in jax.tree_util.tree_flatten_with_path(arg)[0]:
            key = name + jax.tree_util.keystr(path)
            sig[key] = f"{jax.numpy.dtype(x.dtype).name}{list(x.shape)}"
    sig.update({k: repr(v) for k, v in static.items()})
    return sig


def explain(sig: Signature, seen: list[Signature]) -> tuple[dict[str, str], dict[str, str]]:
    """(new, old): the entries of ``sig`` that differ from the closest signature seen before,
    and what those fields were there (new: all of ``sig`` and old empty when none was seen;
    a field the closest signature lacked is in new only)."""
    if not seen:
        return dict(sig), {}
    closest = min(seen, key=lambda s: sum(s.get(k) != v for k, v in sig.items()))
    new = {k: v for k, v in sig.items() if closest.get(k) != v}
    return new, {k: closest[k] for k in new if k in closest}


def describe(new: dict[str, str], old: dict[str, str]) -> str:
    """``field: old -> new`` for each changed field, e.g. for the log."""
    return "; ".join(
        f"{k}: {old[k]} -> {v}" if k in old else f"{k}: {v} (new)" for k, v in new.items()
    )
