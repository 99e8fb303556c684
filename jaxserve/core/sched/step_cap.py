"""StepTokenCap: the most tokens one step may schedule while a server's warm-up goes on.

A server that admits requests before every step shape is compiled (engine/background_warmup.py)
must never schedule a step whose padded shape is not compiled and run yet: that step would
compile on the step path. Warm-up compiles the token buckets in increasing order, so what is
ready is always every bucket up to some size T; the scheduler's token budget is capped at that
T, and the cap rises as larger buckets become ready, until warm-up ends and lifts it. Every
other shape of a step follows from its tokens (rows <= tokens, each bucket compiled at every
block-table width), so the budget is the only limit the scheduler needs.

A request longer than the cap is not refused: its prompt is computed in chunks of the cap (the
scheduler's chunked prefill), and decodes of more running requests than the cap take turns.
The warm-up thread raises the cap; the engine thread reads it in each ``schedule()``: one int
read and written whole, under a lock so that a rise is never lost or undone.
"""

from __future__ import annotations

import threading


class StepTokenCap:
    """The token cap of each step (None: none, the scheduler's own budget).

    Args:
        tokens: the first cap (the largest token bucket warmed up before the engine serves),
            >= 1; None: no cap.
    """

    def __init__(self, tokens: int | None) -> None:
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)):
            raise TypeError(f"StepTokenCap tokens must be an int or None, got {tokens!r}")
        if tokens is not None and tokens < 1:
            raise ValueError(f"StepTokenCap tokens must be >= 1, got {tokens}")
        self._tokens = tokens  # written by the warm-up thread, read by the engine thread
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int | None:
        """The cap now, or None when lifted."""
        return self._tokens

    def budget(self, max_num_batched_tokens: int) -> int:
        """The step's token budget: ``max_num_batched_tokens``, capped."""
        tokens = self._tokens
        return max_num_batched_tokens if tokens is None else min(tokens, max_num_batched_tokens)

    def raise_to(self, tokens: int) -> None:
        """A larger bucket is ready: the cap becomes ``tokens`` (never lower than it was, and
        nothing once lifted)."""
        with self._lock:
            if self._tokens is not None and tokens > self._tokens:
                self._tokens = tokens

    def lift(self) -> None:
        """Warm-up is over: no cap from now on."""
        with self._lock:
            self._tokens = None
