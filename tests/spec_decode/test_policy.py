"""The speculation policy: per batch-size bucket it measures output tokens per second under each
draft length it may choose (arms "k", "fit", "off"), takes the fastest, probes the others within
the probe budget (the slower, the more rarely), and follows a change."""

from __future__ import annotations

import pytest

from jaxserve.spec_decode.policy import (
    MAX_PROBE_INTERVAL,
    MIN_PROBE_INTERVAL,
    MIN_WEIGHT,
    PROBE_BUDGET,
    SpecPolicy,
    probe_interval,
)
from jaxserve.spec_decode.spec_decoder import SpecDecoder, decode_share
from jaxserve.speculative_config import SpeculativeConfig

GPU_BUCKETS = (4, 8, 16, 32, 64)  # powers of two from MIN_TOKEN_BUCKET (runner/buckets.py)
# Steps an arm is tried before it is compared: MIN_WEIGHT of full steps, decayed by 0.95 each
W = next(n for n in range(1, 100) if (1 - 0.95**n) / 0.05 >= MIN_WEIGHT)


def _config(**kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", **{"num_speculative_tokens": 4, **kw})


def _policy(buckets=None, **kw) -> SpecPolicy:
    return SpecPolicy(_config(**kw), buckets)


def _serve(policy: SpecPolicy, num_running: int, tok_s: dict[int, float], steps: int) -> list:
    """``steps`` decisions (drafts per decode), each step emitting 10 tokens at the rate given
    for its draft length."""
    decisions = []
    for _ in range(steps):
        n = policy.num_drafts(num_running)
        decisions.append(n)
        policy.observe_step(10, 10 / tok_s[n])
    return decisions


def test_measures_both_ways_then_takes_the_faster_and_probes_the_other():
    policy = _policy()  # no buckets: arms "k" and "off"
    interval = probe_interval(300.0 / 100.0)
    decisions = _serve(policy, 3, {4: 300.0, 0: 100.0}, 2 * W + 4 * interval)
    assert decisions[: 2 * W] == [4] * W + [0] * W  # speculation measured first, then without
    assert policy.rate(4, "k") == pytest.approx(300.0)
    assert policy.rate(4, "off") == pytest.approx(100.0)
    later = decisions[2 * W :]
    assert later.count(0) == 4  # probes only, one every `interval` steps
    assert [i for i, n in enumerate(later) if not n] == [interval * j - 1 for j in (1, 2, 3, 4)]


def test_one_slow_first_step_does_not_condemn_an_arm():
    """Each arm runs W steps before it is compared: a first step 5x slower than the arm's
    others (a loaded machine) does not make it look slower than "off"."""
    policy = _policy()
    first = True
    for _ in range(W):
        assert policy.num_drafts(1) == 4
        policy.observe_step(10, 10 / (60.0 if first else 300.0))
        first = False
    decisions = _serve(policy, 1, {4: 300.0, 0: 100.0}, W + 50)
    assert decisions[:W] == [0] * W and decisions[W:].count(4) >= 49


@pytest.mark.parametrize("gap", [1.001, 1.05, 1.3, 2.0, 3.0, 50.0])
def test_probes_cost_about_the_budget_of_throughput(gap):
    """A probe step of the arm ``gap`` times slower costs gap - 1 steps of the faster one's
    time; spaced probe_interval(gap) apart, that is at most PROBE_BUDGET of the time, unless
    the interval is at its floor (arms this close lose little either way) or its cap."""
    interval = probe_interval(gap)
    assert MIN_PROBE_INTERVAL <= interval <= MAX_PROBE_INTERVAL
    cost = (gap - 1.0) / interval
    assert cost <= PROBE_BUDGET * (1 + 1e-9) or interval == MAX_PROBE_INTERVAL
    assert cost >= PROBE_BUDGET / 2 or interval == MIN_PROBE_INTERVAL


def test_three_arms_the_fastest_taken_and_the_others_probed_within_the_budget():
    """Batch 1 with power-of-two buckets: a step of 1 token pads to 4, so "fit" is 3 drafts.
    Each arm is measured W steps (k, fit, off), then the fastest runs and the two others share
    the probe budget: their probes together cost about PROBE_BUDGET of the time."""
    policy = _policy(GPU_BUCKETS)
    rates = {4: 250.0, 3: 300.0, 0: 200.0}  # "fit" fastest; gaps 1.2 and 1.5
    steps = 2000
    decisions = _serve(policy, 1, rates, 3 * W + steps)
    assert decisions[: 3 * W] == [4] * W + [3] * W + [0] * W
    later = decisions[3 * W :]
    assert later.count(3) > 0.95 * steps
    assert later.count(4) > 0 and later.count(0) > 0  # both others probed
    cost = sum(rates[3] / rates[n] - 1.0 for n in later) / steps  # extra time, as a share
    assert PROBE_BUDGET / 2 <= cost <= PROBE_BUDGET * 1.05
    stats = policy.stats()
    assert stats["spec_decode_policy_best_arm"] == {1: "fit:3"}
    assert stats["spec_decode_policy_steps_per_length"] == [decisions.count(n) for n in range(5)]


def test_an_arm_that_measures_faster_is_chosen_and_a_change_is_followed():
    policy = _policy(GPU_BUCKETS)
    _serve(policy, 1, {4: 250.0, 3: 300.0, 0: 100.0}, 200)
    assert policy.stats()["spec_decode_policy_best_arm"] == {1: "fit:3"}
    # The text stops repeating: drafts are rejected, "off" is now fastest; seen through the
    # probes, within a few probe intervals.
    decisions = _serve(policy, 1, {4: 50.0, 3: 80.0, 0: 100.0}, 3 * MAX_PROBE_INTERVAL)
    assert decisions[-MIN_PROBE_INTERVAL:].count(0) >= MIN_PROBE_INTERVAL - 2  # 2 others' probes
    assert policy.stats()["spec_decode_policy_best_arm"] == {1: "off:0"}


def test_duplicate_arms_are_collapsed():
    """k = 3 at batch 1 (pads 1 -> 4): "fit" is k, one arm; at batch 4 (no padding left) "fit"
    is "off"; without buckets there is no "fit"."""
    for buckets, k, batch in ((GPU_BUCKETS, 3, 1), (GPU_BUCKETS, 4, 4), (None, 4, 1)):
        policy = _policy(buckets, num_speculative_tokens=k)
        decisions = _serve(policy, batch, {k: 200.0, 0: 100.0}, 300)
        assert decisions[: 2 * W] == [k] * W + [0] * W and set(decisions) == {k, 0}
        assert not policy.fitting


def test_buckets_decide_apart():
    policy = _policy()
    steps = 3 * probe_interval(2.0)
    _serve(policy, 200, {4: 50.0, 0: 100.0}, steps)  # big batch: speculation loses
    assert policy.rate(256, "k") < policy.rate(256, "off")
    _serve(policy, 2, {4: 300.0, 0: 100.0}, steps)  # small batch: it wins
    assert policy.rate(2, "k") > policy.rate(2, "off")
    assert policy.rate(256, "k") < policy.rate(256, "off")  # the big bucket kept its own
    decisions = _serve(policy, 200, {4: 400.0, 0: 100.0}, 2 * steps)  # it turns repetitive
    assert decisions[-MIN_PROBE_INTERVAL:].count(4) >= MIN_PROBE_INTERVAL - 1


def test_always_and_disable_by_batch_size():
    policy = _policy(GPU_BUCKETS, policy="always", disable_by_batch_size=8)
    assert policy.num_drafts(1) == 4 and not policy.fitting  # "always" keeps k
    assert policy.num_drafts(8) == 4
    assert policy.num_drafts(9) == 0
    assert policy.num_drafts(0) == 0
    assert policy.stats()["spec_decode_policy_steps_per_length"] == [1, 0, 0, 0, 2]


def test_the_fit_arm_caps_the_step_at_its_padded_size():
    """SpecDecoder hands the scheduler a step cap only under the "fit" arm: the bucket the
    step's other tokens pad to."""
    spec = SpecDecoder(_config(), proposer=_NoProposer(), token_buckets=GPU_BUCKETS)
    # measured: "fit" fastest at batch 1 ([tokens, seconds, steps])
    spec.policy._rates[(1, "k")] = [10.0, 1.0, MIN_WEIGHT]
    spec.policy._rates[(1, "off")] = [10.0, 1.0, MIN_WEIGHT]
    spec.policy._rates[(1, "fit")] = [30.0, 1.0, MIN_WEIGHT]
    spec.propose([])  # nothing running: no decision, no cap
    assert spec.max_step_tokens is None
    assert spec.policy.num_drafts(1) == 3
    cap = spec.max_step_tokens
    assert cap is not None and [cap(n) for n in (1, 4, 5, 9)] == [4, 4, 8, 16]
    spec.policy._rates[(1, "k")] = [90.0, 1.0, MIN_WEIGHT]
    assert spec.policy.num_drafts(1) == 4 and spec.max_step_tokens is None


class _NoProposer:
    def propose(self, requests, k):
        return {}


def test_steps_count_by_their_decode_share():
    """A step spent on prefill chunks (weight 0) leaves the measurements as they were; a half
    decode step counts half, and decays the past by half a step's worth."""
    policy = _policy()
    policy.num_drafts(3)  # speculation measured first
    policy.observe_step(1, 5.0, weight=0.0)  # a prefill step: says nothing
    assert policy.rate(4, "k") is None
    policy.observe_step(10, 0.1)
    assert policy.rate(4, "k") == pytest.approx(100.0)
    policy.observe_step(10, 0.05, weight=0.5)  # the same decision's next step, half decode
    decay = 0.95**0.5
    assert policy.rate(4, "k") == pytest.approx((decay * 10 + 5) / (decay * 0.1 + 0.025))


def test_decode_share_of_a_step():
    # a: decode with 2 drafts (3 tokens), b: a decode, c: a prefill chunk of 6
    num_scheduled = {"a": 3, "b": 1, "c": 6}
    assert decode_share(num_scheduled, {"a": [5, 6]}) == pytest.approx(0.4)
    assert decode_share({}, {}) == 0.0
