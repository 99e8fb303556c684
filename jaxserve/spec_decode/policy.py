"""SpecPolicy: when speculating pays, measured as throughput, by batch size.

Verifying k drafts per request makes a step compute up to 1 + k tokens per request instead of
one, and costs host work (proposing, bookkeeping, more sampling rows). Where the step's cost
hardly grows with its tokens (small batches, or a large model on an accelerator: weights and
overheads dominate), accepted drafts are nearly free tokens; where it grows in proportion (large
batches on a compute-bound device; small models on the CPU), every rejected draft is lost work.
Predicting that from a cost model of the device misses the host's share (measured on the CPU
with a 1M-parameter model: a bucket-cost model predicted a gain where speculating lost 20%), so
the policy measures what it decides on: output tokens per second of the engine's steps, with
speculation and without, per batch-size bucket (the running requests, rounded up to a power of
two), each a ratio of exponentially decayed sums of tokens emitted and step seconds (scheduling,
the device step, the update and the proposal).

In a bucket it has not measured both ways, it tries the missing way; afterwards it takes the
faster, and now and then one step of the other (a probe), so both stay measured as the text, the
batch and the acceptance rate change. A probe of a mode ``gap`` times slower costs about
``gap - 1`` steps' worth of throughput, so the probes are spaced ``(gap - 1) / PROBE_BUDGET``
steps apart (within [MIN_PROBE_INTERVAL, MAX_PROBE_INTERVAL]): their cost stays near
PROBE_BUDGET (1%) of throughput however much the other mode loses, and modes that measure close
are probed often. vLLM's disable_by_batch_size applies on top; "always" speculates at every
batch size.
"""

from __future__ import annotations

import math

from jaxserve.speculative_config import SpeculativeConfig

PROBE_BUDGET = 0.01  # the share of throughput the probes of the slower mode may cost
MIN_PROBE_INTERVAL, MAX_PROBE_INTERVAL = 16, 256  # the fewest and the most steps between probes
_DECAY = 0.95  # weight of the past in the decayed sums


def probe_interval(gap: float) -> int:
    """Steps between probes of a mode measured ``gap`` (>= 1) times slower than the other."""
    steps = math.ceil((gap - 1.0) / PROBE_BUDGET - 1e-6)  # a measured 3.0 may be 3.0000000001
    return max(MIN_PROBE_INTERVAL, min(MAX_PROBE_INTERVAL, steps))


class SpecPolicy:
    """Decides, step by step, whether running decodes carry drafts."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.auto = config.policy == "auto"
        self.disable_by_batch_size = config.disable_by_batch_size
        # (batch bucket, speculating?) -> decayed [tokens emitted, seconds]
        self._rates: dict[tuple[int, bool], list[float]] = {}
        self._pending: tuple[int, bool] | None = None  # the decision the next step runs under
        self._since_probe: dict[int, int] = {}  # batch bucket -> steps since its last probe

    def num_drafts(self, num_running: int) -> int:
        """k, or 0 for no speculation in the next step."""
        cap = self.disable_by_batch_size
        if num_running == 0 or (cap is not None and num_running > cap):
            self._pending = None
            return 0
        if not self.auto:
            return self.k
        bucket = 1 << (num_running - 1).bit_length()
        on = self._choose(bucket)
        self._pending = (bucket, on)
        return self.k if on else 0

    def _choose(self, bucket: int) -> bool:
        on, off = self.rate(bucket, True), self.rate(bucket, False)
        if on is None or off is None:
            return on is None  # measure the missing way, speculation first
        best = on > off
        since = self._since_probe.get(bucket, 0) + 1
        probe = since >= probe_interval(max(on, off) / min(on, off))
        self._since_probe[bucket] = 0 if probe else since
        return best != probe

    def rate(self, bucket: int, speculating: bool) -> float | None:
        """Measured output tokens per second in a batch bucket, with or without speculation."""
        sums = self._rates.get((bucket, speculating))
        return None if sums is None or sums[1] <= 0.0 else sums[0] / sums[1]

    def observe_step(self, num_emitted: int, seconds: float, weight: float = 1.0) -> None:
        """The step just run under the last decision: tokens it emitted, its wall time, and
        how much it counts (0..1: the decodes' share of its tokens; a step spent on prefill
        chunks says little about speculation, and a slow one would count against whichever
        mode it ran under). A weight w decays the past by _DECAY ** w."""
        if self._pending is None or seconds <= 0.0 or weight <= 0.0:
            return
        sums = self._rates.setdefault(self._pending, [0.0, 0.0])
        decay = _DECAY**weight
        sums[0] = decay * sums[0] + weight * num_emitted
        sums[1] = decay * sums[1] + weight * seconds
