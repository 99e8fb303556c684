"""SpecPolicy: when speculating pays, measured as throughput, by batch size.

Verifying k drafts per request makes a step compute up to 1 + k tokens per request instead of
one, and costs host work (proposing, bookkeeping, more sampling rows). Where the step's cost
hardly grows with its tokens (small batches, or a large model on an accelerator: weights and
overheads dominate), accepted drafts are nearly free tokens; where it grows in proportion (large
batches on a compute-bound device; small models on the CPU), every rejected draft is lost work.
Predicting that from a cost model of the device misses the host's share (measured on the CPU
with a 1M-parameter model: a bucket-cost model predicted a gain where speculating lost 20%), so
the policy measures what it decides on: output tokens per second of the engine's steps, under
each draft length it may choose, per batch-size bucket (the running requests, rounded up to a
power of two), each a ratio of exponentially decayed sums of tokens emitted and step seconds
(scheduling, the device step, the update and the proposal).

The ways it measures are arms, draft lengths (draft_arms.py): "k" drafts per decode, "fit"
(as many as the step's padding rows hold: nearly free on every platform) and "off"; arms of
equal length are one. In a bucket where an arm has fewer than MIN_WEIGHT (decayed) steps
measured, it tries it; afterwards it takes the fastest, and now and then one step of another
(a probe), so all stay measured as the text, the batch and the acceptance rate change. A probe
of an arm ``gap`` times slower costs about ``gap - 1`` steps' worth of throughput, so its
probes are spaced ``(gap - 1) / budget`` steps apart (within [MIN_PROBE_INTERVAL,
MAX_PROBE_INTERVAL]), ``budget`` being PROBE_BUDGET (1%) shared by the other arms: the probes'
cost stays near it however much the other arms lose, and arms that measure close are probed
often. vLLM's disable_by_batch_size applies on top; "always" speculates with k drafts at every
batch size.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from jaxserve.spec_decode.draft_arms import draft_arms
from jaxserve.speculative_config import SpeculativeConfig

logger = logging.getLogger("jaxserve")

PROBE_BUDGET = 0.01  # the share of throughput the probes of the slower arms may cost
MIN_PROBE_INTERVAL, MAX_PROBE_INTERVAL = 16, 256  # the fewest and the most steps between probes
_DECAY = 0.95  # weight of the past in the decayed sums
# Steps' worth of weight an arm needs before it is compared: single steps vary by several
# times on a loaded machine (3-16 ms for the same one-token step of the 1M model), and an arm
# judged on one slow step was then probed only every ~150 steps.
MIN_WEIGHT = 4.0


def probe_interval(gap: float, budget: float = PROBE_BUDGET) -> int:
    """Steps between probes of an arm measured ``gap`` (>= 1) times slower than the best, for
    its probes to cost about ``budget`` of throughput."""
    steps = math.ceil((gap - 1.0) / budget - 1e-6)  # a measured 3.0 may be 3.0000000001
    return max(MIN_PROBE_INTERVAL, min(MAX_PROBE_INTERVAL, steps))


class SpecPolicy:
    """Decides, step by step, how many drafts running decodes carry (an arm, draft_arms.py).

    Args:
        config: the validated speculative_config (k, policy, disable_by_batch_size).
        token_buckets: the runner's token buckets, ascending (plain ints): they give the "fit"
            arm; None: arms "k" and "off" only.
    """

    def __init__(self, config: SpeculativeConfig, token_buckets: Sequence[int] | None = None):
        self.k = config.num_speculative_tokens
        self.auto = config.policy == "auto"
        self.disable_by_batch_size = config.disable_by_batch_size
        self.token_buckets = tuple(token_buckets) if token_buckets else None
        # (batch bucket, arm) -> decayed [tokens emitted, seconds, steps]
        self._rates: dict[tuple[int, str], list[float]] = {}
        self._pending: tuple[int, str] | None = None  # the decision the next step runs under
        self._since_probe: dict[tuple[int, str], int] = {}  # steps since the arm's last probe
        self._best: dict[int, tuple[str, int]] = {}  # batch bucket -> fastest arm, its drafts
        self.fitting = False  # whether the last decision's drafts must fit the step's padding
        self.steps_per_length = [0] * (self.k + 1)  # decisions by drafts per decode (get_stats)

    def num_drafts(self, num_running: int) -> int:
        """Drafts per running decode in the next step (0: no speculation)."""
        self._pending, self.fitting = None, False
        cap = self.disable_by_batch_size
        if num_running == 0:
            return 0
        if cap is not None and num_running > cap:
            n = 0
        elif not self.auto:
            n = self.k
        else:
            bucket = 1 << (num_running - 1).bit_length()
            arms = draft_arms(num_running, self.k, self.token_buckets)
            arm = self._choose(bucket, arms)
            self._pending, self.fitting, n = (bucket, arm), arm == "fit", arms[arm]
        self.steps_per_length[n] += 1
        return n

    def _choose(self, bucket: int, arms: dict[str, int]) -> str:
        """The arm of the next step in a batch bucket: a missing one first, else the fastest
        measured, or another one whose probe is due (each of the m others probed within
        PROBE_BUDGET / m, so that all the probes together stay within the budget)."""
        missing = [arm for arm in arms if self._weight(bucket, arm) < MIN_WEIGHT]
        if missing:
            return missing[0]
        rates = {arm: self.rate(bucket, arm) for arm in arms}
        best = max(rates, key=rates.__getitem__)
        changed = self._best.get(bucket, ("",))[0] != best
        self._best[bucket] = (best, arms[best])
        if changed:
            logger.debug("speculation: batch bucket %d runs arm %s (%d drafts; tok/s %s)",
                         bucket, best, arms[best],
                         {a: round(r) for a, r in rates.items()})  # fmt: skip
        others = [arm for arm in arms if arm != best]
        budget, due = PROBE_BUDGET / len(others), None
        for arm in others:
            since = self._since_probe.get((bucket, arm), 0) + 1
            if due is None and since >= probe_interval(rates[best] / rates[arm], budget):
                due, since = arm, 0
            self._since_probe[(bucket, arm)] = since
        return due or best

    def rate(self, bucket: int, arm: str) -> float | None:
        """Measured output tokens per second in a batch bucket under an arm."""
        sums = self._rates.get((bucket, arm))
        return None if sums is None or sums[1] <= 0.0 else sums[0] / sums[1]

    def _weight(self, bucket: int, arm: str) -> float:
        """The decayed count of steps measured under an arm (each weighted as observed)."""
        sums = self._rates.get((bucket, arm))
        return 0.0 if sums is None else sums[2]

    def stats(self) -> dict[str, object]:
        """get_stats() keys: decisions by drafts per decode, and each batch bucket's fastest
        measured arm ("auto" only) as "arm:drafts per decode" (when last measured)."""
        best = {bucket: f"{arm}:{n}" for bucket, (arm, n) in sorted(self._best.items())}
        return {"spec_decode_policy_steps_per_length": list(self.steps_per_length),
                "spec_decode_policy_best_arm": best}  # fmt: skip

    def observe_step(self, num_emitted: int, seconds: float, weight: float = 1.0) -> None:
        """The step just run under the last decision: tokens it emitted, its wall time, and
        how much it counts (0..1: the decodes' share of its tokens; a step spent on prefill
        chunks says little about speculation, and a slow one would count against whichever
        arm it ran under). A weight w decays the past by _DECAY ** w."""
        if self._pending is None or seconds <= 0.0 or weight <= 0.0:
            return
        sums = self._rates.setdefault(self._pending, [0.0, 0.0, 0.0])
        decay = _DECAY**weight
        sums[0] = decay * sums[0] + weight * num_emitted
        sums[1] = decay * sums[1] + weight * seconds
        sums[2] = decay * sums[2] + weight
