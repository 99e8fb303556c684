"""RunAheadPolicy: whether async scheduling runs one step ahead, measured as throughput, by
batch size (issue 34).

Running ahead (EngineCore.step: the next step scheduled and dispatched before the last one is
learned) hides the host's work behind the device's step. On an accelerator the host's work
and the device's are on different chips and it always pays. On the CPU the "device" is the
host's own cores: the overlap takes from the step what it gives back, and which wins depends
on the model and the batch (the 57M model at 256 running decodes lost 2-3% a step, the demo
model gained 1.1-1.5x at every batch: docs/benchmarks.md), and the host's share of a step
does not separate the two (3.1% at batch 16, a gain; 3-4% at 256, a loss). So the CPU's plan
measures instead (ExecutionPlan.run_ahead == "measured"): output tokens per second of the
engine's decode steps under each arm, "ahead" and "sync", per batch bucket (the running
requests rounded up to a power of two), as exponentially decayed sums of tokens and seconds
from one step's end to the next (the caller's work on the outputs included: it is what the
overlap hides too).

An arm runs for RUN_STEPS steps at a time: the first step after a switch is a transition (a
step ahead dispatched beside the last one, or a step in flight only learned) and is not
measured. A bucket measures each arm first (MIN_WEIGHT decayed steps), then takes the faster
one ("sync" only when faster by SYNC_MARGIN: the risks are not even, running ahead gained up
to 1.5x where it gains and lost 3% where it loses, and single steps on a loaded machine vary
by several times) and now and then runs the other for RUN_STEPS steps (a probe), spaced so
that the probes of an arm ``gap`` times slower cost about PROBE_BUDGET of throughput (as
spec_decode/policy.py spaces its probes), so both stay measured as the load and the batch
change. Host side: no jax.
"""

from __future__ import annotations

import logging
import math
import time

logger = logging.getLogger("jaxserve")

ARMS = ("ahead", "sync")  # the order a bucket measures them in
RUN_STEPS = 6  # steps an arm runs at a time (a trial or a probe), its first not measured
MIN_WEIGHT = 8.0  # decayed measured steps an arm needs before the arms are compared
PROBE_BUDGET = 0.005  # the share of throughput the slower arm's probes may cost
MIN_PROBE_INTERVAL, MAX_PROBE_INTERVAL = 48, 1024  # steps between two probes' starts
SYNC_MARGIN = 0.01  # how much faster "sync" must measure to be taken over "ahead"
_DECAY = 0.97  # weight of the past in the decayed sums


def probe_interval(gap: float, budget: float = PROBE_BUDGET) -> int:
    """Steps between the starts of two probes (RUN_STEPS steps each) of an arm ``gap`` (>= 1)
    times slower than the best, for them to cost about ``budget`` of throughput."""
    steps = math.ceil(RUN_STEPS * (gap - 1.0) / budget - 1e-6)
    return max(MIN_PROBE_INTERVAL, min(MAX_PROBE_INTERVAL, steps))


class RunAheadPolicy:
    """Decides, step by step, whether EngineCore runs the next step ahead (see the module
    docstring). ``run_ahead`` before each step, ``observe`` after it."""

    def __init__(self) -> None:
        self._rates: dict[tuple[int, str], list[float]] = {}  # -> decayed [tokens, s, steps]
        self._arm = ARMS[0]  # the arm of the last decision
        self._bucket = 0  # ... and its batch bucket
        self._left = 0  # steps its current run has left
        self._transition = True  # the last decision switched arms: its step is not measured
        self._since_probe: dict[int, int] = {}  # bucket -> steps since its last probe began
        self._best: dict[int, str] = {}  # bucket -> the faster arm, when both are measured
        self._last_end: float | None = None  # perf_counter when the last step ended
        self.steps = dict.fromkeys(ARMS, 0)  # decisions by arm (get_stats)

    def run_ahead(self, num_running: int) -> bool:
        """Whether the next step runs ahead, with ``num_running`` requests running."""
        bucket = 1 << max(num_running - 1, 0).bit_length()
        if bucket != self._bucket or self._left <= 0:
            arm = self._choose(bucket)
            self._left = RUN_STEPS
        else:
            arm = self._arm
        self._transition = arm != self._arm
        self._arm, self._bucket = arm, bucket
        self._left -= 1
        self.steps[arm] += 1
        return arm == "ahead"

    def _choose(self, bucket: int) -> str:
        """The arm of the next run in ``bucket``: an arm not yet measured, else the faster
        one, or the other when its probe is due."""
        missing = [arm for arm in ARMS if self._weight(bucket, arm) < MIN_WEIGHT]
        if missing:
            return missing[0]
        rates = {arm: self.rate(bucket, arm) for arm in ARMS}
        best = "sync" if rates["sync"] > rates["ahead"] * (1.0 + SYNC_MARGIN) else "ahead"
        if self._best.get(bucket) != best:
            self._best[bucket] = best
            logger.debug("async scheduling: batch bucket %d runs %s (tok/s %s)", bucket, best,
                         {a: round(r) for a, r in rates.items()})  # fmt: skip
        other = ARMS[1 - ARMS.index(best)]
        since = self._since_probe.get(bucket, 0) + RUN_STEPS
        if since >= probe_interval(rates[best] / max(rates[other], 1e-9)):
            self._since_probe[bucket] = 0
            return other
        self._since_probe[bucket] = since
        return best

    def observe(self, num_tokens: int, decode_only: bool, now: float | None = None) -> None:
        """The step just run under the last decision: tokens it emitted, and whether the step
        it learned was all decodes (a step with prefill chunks says little about the arms);
        its time runs from the last step's end to ``now`` (default: the clock)."""
        now = time.perf_counter() if now is None else now
        last, self._last_end = self._last_end, now
        if last is None or now <= last or self._transition or not decode_only or num_tokens <= 0:
            return
        sums = self._rates.setdefault((self._bucket, self._arm), [0.0, 0.0, 0.0])
        sums[0] = _DECAY * sums[0] + num_tokens
        sums[1] = _DECAY * sums[1] + (now - last)
        sums[2] = _DECAY * sums[2] + 1.0

    def rate(self, bucket: int, arm: str) -> float:
        """Measured output tokens per second in ``bucket`` under ``arm`` (0.0: none)."""
        sums = self._rates.get((bucket, arm))
        return 0.0 if sums is None or sums[1] <= 0.0 else sums[0] / sums[1]

    def _weight(self, bucket: int, arm: str) -> float:
        sums = self._rates.get((bucket, arm))
        return 0.0 if sums is None else sums[2]

    def stats(self) -> dict[str, object]:
        """get_stats() keys: steps by arm, and each batch bucket's faster arm once measured."""
        return {"async_policy_steps": dict(self.steps),
                "async_policy_best_arm": dict(sorted(self._best.items()))}  # fmt: skip
