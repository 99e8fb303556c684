"""SpecPolicy: when speculating pays, from measured step times and the measured acceptance.

Verifying k drafts per request makes a decode step compute 1 + k tokens per request instead of
one. Where the step's cost hardly grows with its tokens (small batches: weights and overheads
dominate), the accepted drafts are nearly free tokens; where it grows in proportion (large
batches: the step is compute-bound), every rejected draft is lost work. The policy keeps both
sides measured:

- step cost: seconds = a + b * tokens, a least-squares line over recent steps (exponentially
  decayed sums, O(1) per step), fed the scheduled token count and wall time of every step;
- acceptance: drafts proposed per request and accepted drafts per draft, decayed averages
  over recent verification steps.

Before each step with R running decodes, the expected speed-up of speculating is
    (1 + accepted_per_draft * d) * cost(R) / cost(R * (1 + d)),    d = drafts per request,
and the policy speculates while it exceeds 1. It still speculates on one step in PROBE_EVERY
while it is off, so that acceptance and costs stay measured and speculation resumes when the
batch shrinks or the text turns repetitive. vLLM's disable_by_batch_size applies on top.
"""

from __future__ import annotations

from jaxserve.speculative_config import SpeculativeConfig

PROBE_EVERY = 32  # steps between probes while speculation is off
_DECAY = 0.95  # weight of the past in every running average
_MIN_STEPS = 8  # observed steps before the cost line is trusted (until then: speculate)


class SpecPolicy:
    """Decides, step by step, whether running decodes carry drafts."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.auto = config.policy == "auto"
        self.disable_by_batch_size = config.disable_by_batch_size
        self._sums = [0.0] * 5  # decayed sums of 1, x, x^2, y, x*y (x tokens, y seconds)
        self._num_steps = 0
        self.drafts_per_request = float(self.k)  # decayed mean of drafts a request got
        self.accepted_per_draft = 1.0  # decayed mean of accepted / verified drafts
        self._steps_off = 0
        self.enabled = True  # the last decision (logged by the engine when it changes)

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
        if self._num_steps < _MIN_STEPS:
            return float("inf")
        d = self.drafts_per_request
        plain, spec = self.step_cost(num_running), self.step_cost(num_running * (1.0 + d))
        if plain <= 0.0 or spec <= 0.0:
            return float("inf")  # the line is not yet meaningful: keep measuring
        return (1.0 + self.accepted_per_draft * d) * plain / spec

    def step_cost(self, num_tokens: float) -> float:
        """Predicted seconds of a step of ``num_tokens`` tokens (the fitted line)."""
        n, sx, sxx, sy, sxy = self._sums
        var = n * sxx - sx * sx
        if var <= 1e-9 * max(n * sxx, 1.0):  # one size seen so far: a flat cost
            return sy / n if n else 0.0
        slope = (n * sxy - sx * sy) / var
        slope = max(slope, 0.0)  # noise must not make more tokens cheaper
        intercept = (sy - slope * sx) / n
        return intercept + slope * num_tokens

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0:
            return
        s = self._sums
        x, y = float(num_tokens), float(seconds)
        for i, v in enumerate((1.0, x, x * x, y, x * y)):
            s[i] = _DECAY * s[i] + v
        self._num_steps += 1

    def observe_drafts(self, num_requests: int, num_proposed: int) -> None:
        """A proposal round: ``num_proposed`` drafts over ``num_requests`` eligible decodes."""
        if num_requests:
            mean = num_proposed / num_requests
            self.drafts_per_request = _DECAY * self.drafts_per_request + (1 - _DECAY) * mean

    def observe_acceptance(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens:
            rate = num_accepted / num_draft_tokens
            self.accepted_per_draft = _DECAY * self.accepted_per_draft + (1 - _DECAY) * rate
