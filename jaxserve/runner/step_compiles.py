"""Compilations of the runner's jitted step: counted (fresh, or loaded from the persistent
cache) and, once warm-up is done, explained.

A compilation after warm-up costs seconds (minutes on TPU) in the middle of serving, so each one
logs a warning that names the function and the arguments whose shape, dtype or static value no
earlier compilation had, and is kept in ``events`` (get_stats()["recompilations"]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxserve.runner.compile_cache import CacheHits

logger = logging.getLogger("jaxserve")

Signature = dict[str, str]  # argument name -> its shapes / dtypes, or its static value


class TraceCounter:
    """Traces of a jitted function; the traced function increments ``count`` (it runs once per
    trace, never when a compiled executable is reused)."""

    def __init__(self) -> None:
        self.count = 0


class StepCompiles:
    """Runs a jitted function and keeps track of its compilations.

    Args:
        name: the function's name, for messages.
        traces: the counter its traced body increments.
    """

    def __init__(self, name: str, traces: TraceCounter) -> None:
        self.name = name
        self.traces = traces
        self.num_fresh = 0  # compiled here
        self.num_cache_hits = 0  # loaded from the persistent compilation cache
        self.warmed_up = False  # set by the runner when its warm-up is done
        self.events: list[dict[str, Any]] = []  # compilations after warm-up, explained
        self._seen: list[Signature] = []

    def __call__(
        self, fn: Callable[..., Any], args: Sequence[Any], names: Sequence[str], **static: Any
    ) -> Any:
        """``fn(*args, **static)``; ``names`` name the positional args (for explanations)."""
        traces, hits = self.traces.count, CacheHits.count()
        out = fn(*args, **static)
        if self.traces.count != traces:
            self._compiled(signature(args, names, static), CacheHits.count() > hits)
        return out

    def _compiled(self, sig: Signature, from_cache: bool) -> None:
        if from_cache:
            self.num_cache_hits += 1
        else:
            self.num_fresh += 1
        if self.warmed_up:
            new = explain(sig, self._seen)
            self.events.append({"function": self.name, "new": new, "from_cache": from_cache})
            logger.warning(
                "%s compiled after warm-up%s, for a new %s",
                self.name,
                " (loaded from the compilation cache)" if from_cache else "",
                "; ".join(f"{k}={v}" for k, v in new.items()),
            )
        self._seen.append(sig)


def signature(args: Sequence[Any], names: Sequence[str], static: dict[str, Any]) -> Signature:
    """Each argument's leaves as dtype[shape] (static values as they are)."""
    sig = {}
    for name, arg in zip(names, args, strict=True):
        leaves = jax.tree_util.tree_leaves(arg)
        sig[name] = ", ".join(f"{jax.numpy.dtype(x.dtype).name}{list(x.shape)}" for x in leaves)
    sig.update({k: repr(v) for k, v in static.items()})
    return sig


def explain(sig: Signature, seen: list[Signature]) -> dict[str, str]:
    """The entries of ``sig`` that differ from the closest signature seen before (all of them
    when none was)."""
    if not seen:
        return dict(sig)
    closest = min(seen, key=lambda s: sum(s.get(k) != v for k, v in sig.items()))
    return {k: v for k, v in sig.items() if closest.get(k) != v}
