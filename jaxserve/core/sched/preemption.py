"""PreemptionPolicy: whether a preempted request's KV is swapped to the host tier or dropped
and recomputed later (CacheConfig.preemption_mode).

"recompute" always drops it; "swap" always tries the host tier (the KV manager falls back to
recompute when the tier cannot take the blocks); "auto" decides per request with a cost model
of measured rates, in seconds of wall time:

    swap cost      = 2 * swap_latency_s
                     + blocks copied (down now, up on resume) * block bytes / swap_bytes_per_s
    recompute cost = tokens to recompute / prefill_tokens_per_s

and swaps when the swap cost is lower. The tokens to recompute are the request's computed tokens
less those of its leading hashed blocks when prefix caching is on: those come back as prefix
hits (from the device, or the host tier, which a preempted request's evicted blocks reach like
any others), so recomputing them is not the cost. ``swap_bytes_per_s`` and ``swap_latency_s``
(one transfer's fixed cost; a swap takes one each way) are measured by the runner at start-up
(runner/kv_offload.py); ``prefill_tokens_per_s`` is measured while serving: the engine reports
each step's scheduled tokens and wall time (``observe_step``), and the rate is the ratio of
their exponentially decayed sums, so prefill-heavy steps, which carry most tokens, dominate it.
A preemption needs a step to have run, so a rate exists by then; before any step, or without a
measured bandwidth, "auto" recomputes.
"""

from __future__ import annotations

from jaxserve.config import PREEMPTION_MODES

_DECAY = 0.9  # weight of the history against the newest step in the prefill rate


class PreemptionPolicy:
    """The preemption mode and, for "auto", its two measured rates.

    Args:
        mode: one of PREEMPTION_MODES.
        swap_bytes_per_s: device <-> host bandwidth (0: unknown, "auto" never swaps).
        block_bytes: bytes one block copy moves.
        swap_latency_s: the fixed seconds of one transfer, whatever its size.
    """

    def __init__(
        self,
        mode: str,
        swap_bytes_per_s: float = 0.0,
        block_bytes: int = 0,
        swap_latency_s: float = 0.0,
    ) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        self.mode = mode
        self.swap_bytes_per_s = swap_bytes_per_s
        self.block_bytes = block_bytes
        self.swap_latency_s = swap_latency_s
        # Decayed sums of the observed steps (tokens, seconds); mutated by observe_step only.
        self._tokens = 0.0
        self._seconds = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0 else 0.0

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """One engine step computed ``num_tokens`` tokens in ``seconds`` of wall time."""
        if num_tokens > 0 and seconds > 0:
            self._tokens = _DECAY * self._tokens + num_tokens
            self._seconds = _DECAY * self._seconds + seconds

    def wants_swap(self, num_blocks_to_copy: int, num_tokens_to_recompute: int) -> bool:
        """Whether to try swapping a victim that would copy this many blocks (both ways), or
        else recompute this many tokens."""
        if self.mode != "auto":
            return self.mode == "swap"
        rate = self.prefill_tokens_per_s
        if rate <= 0 or self.swap_bytes_per_s <= 0:
            return False
        swap_s = 2 * self.swap_latency_s
        swap_s += num_blocks_to_copy * self.block_bytes / self.swap_bytes_per_s
        return swap_s < num_tokens_to_recompute / rate
