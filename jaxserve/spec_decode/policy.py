"""SpecPolicy: when speculating pays, from measured step times and the measured acceptance.

Verifying k drafts per request makes a decode step compute 1 + k tokens per request instead of
one. Where the step's cost hardly grows with its tokens (small batches: weights and overheads
dominate), the accepted drafts are nearly free tokens; where it grows in proportion (large
batches: the step is compute-bound), every rejected draft is lost work. The policy keeps both
sides measured:

- step cost by token bucket: a step's cost is set by its padded token count T (the compiled
  shape), so the policy keeps a decayed mean of the wall time of the steps of each bucket
  (every step, speculating or not, prefill or decode, feeds it); a bucket not yet seen is
  interpolated between its measured neighbours, or extrapolated in proportion to T above the
  largest (a compute-bound guess: it errs towards not speculating);
- acceptance: drafts proposed per request and accepted drafts per draft, decayed means over
  recent proposal and verification steps.

Before each step with R running decodes, the expected speed-up of speculating is
    (1 + accepted_per_draft * d) * cost(T(R)) / cost(T(R * (1 + d))),   d = drafts per request,
and the policy speculates while it exceeds 1 (nothing measured yet: it speculates, to measure).
While off it still speculates one step in PROBE_EVERY, so that acceptance stays measured and
speculation resumes when the batch shrinks or the text turns repetitive. vLLM's
disable_by_batch_size applies on top.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from jaxserve.speculative_config import SpeculativeConfig

PROBE_EVERY = 32  # steps between probes while speculation is off
_DECAY = 0.9  # weight of the past in every running mean


class SpecPolicy:
    """Decides, step by step, whether running decodes carry drafts.

    Args:
        config: the validated speculative_config.
        padded_tokens: the runner's token bucket of a step of n tokens (identity when None).
    """

    def __init__(
        self, config: SpeculativeConfig, padded_tokens: Callable[[int], int] | None = None
    ) -> None:
        self.k = config.num_speculative_tokens
        self.auto = config.policy == "auto"
        self.disable_by_batch_size = config.disable_by_batch_size
        self.padded_tokens = padded_tokens or (lambda n: n)
        self._cost: dict[int, float] = {}  # token bucket -> decayed mean step seconds
        self.drafts_per_request = float(self.k)  # decayed mean of drafts a request got
        self.accepted_per_draft = 1.0  # decayed mean of accepted / verified drafts
        self._steps_off = 0
        self.enabled = True  # the last decision

    def num_drafts(self, num_running: int) -> int:
        """k, or 0 for no speculation in the next step."""
        cap = self.disable_by_batch_size
        if num_running == 0 or (cap is not None and num_running > cap):
            return 0
        if not self.auto:
            return self.k
        self.enabled = self.expected_speedup(num_running) > 1.0
        if self.enabled:
            self._steps_off = 0
            return self.k
        self._steps_off += 1
        return self.k if self._steps_off % PROBE_EVERY == 0 else 0

    def expected_speedup(self, num_running: int) -> float:
        """Output tokens per second with speculation over without, for this many decodes."""
        d = self.drafts_per_request
        plain = self.step_cost(num_running)
        spec = self.step_cost(round(num_running * (1.0 + d)))
        if plain is None or spec is None or spec <= 0.0:
            return float("inf")  # not measured yet: speculate, and measure
        return (1.0 + self.accepted_per_draft * d) * plain / spec

    def step_cost(self, num_tokens: int) -> float | None:
        """Predicted seconds of a step of ``num_tokens`` tokens; None before any step."""
        cost = self._cost
        if not cost:
            return None
        bucket = self.padded_tokens(max(num_tokens, 1))
        if bucket in cost:
            return cost[bucket]
        known = sorted(cost)
        i = bisect.bisect_left(known, bucket)
        if i == len(known):  # above every measured bucket: in proportion to T
            return cost[known[-1]] * bucket / known[-1]
        if i == 0:  # below every measured bucket: no cheaper than... the smallest known
            return cost[known[0]]
        lo, hi = known[i - 1], known[i]
        w = (bucket - lo) / (hi - lo)
        return (1 - w) * cost[lo] + w * cost[hi]

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0:
            return
        bucket = self.padded_tokens(num_tokens)
        old = self._cost.get(bucket)
        self._cost[bucket] = seconds if old is None else _DECAY * old + (1 - _DECAY) * seconds

    def observe_drafts(self, num_requests: int, num_proposed: int) -> None:
        """A proposal round: ``num_proposed`` drafts over ``num_requests`` eligible decodes."""
        if num_requests:
            mean = num_proposed / num_requests
            self.drafts_per_request = _DECAY * self.drafts_per_request + (1 - _DECAY) * mean

    def observe_acceptance(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens:
            rate = num_accepted / num_draft_tokens
            self.accepted_per_draft = _DECAY * self.accepted_per_draft + (1 - _DECAY) * rate
