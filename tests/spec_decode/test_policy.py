"""The speculation policy: it measures output tokens per second with and without speculation
per batch-size bucket, takes the faster, probes the other (the slower, the more rarely), and
follows a change."""

from __future__ import annotations

import pytest

from jaxserve.spec_decode.policy import (
    MAX_PROBE_INTERVAL,
    MIN_PROBE_INTERVAL,
    PROBE_BUDGET,
    SpecPolicy,
    probe_interval,
)
from jaxserve.spec_decode.spec_decoder import decode_share
from jaxserve.speculative_config import SpeculativeConfig


def _policy(**kw) -> SpecPolicy:
    return SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4, **kw))


def _serve(policy: SpecPolicy, num_running: int, tok_s: dict[bool, float], steps: int) -> list:
    """``steps`` decisions, each step emitting 10 tokens at the given rate of its mode."""
    decisions = []
    for _ in range(steps):
        on = policy.num_drafts(num_running) > 0
        decisions.append(on)
        policy.observe_step(10, 10 / tok_s[on])
    return decisions


def test_measures_both_ways_then_takes_the_faster_and_probes_the_other():
    policy = _policy()
    interval = probe_interval(300.0 / 100.0)
    decisions = _serve(policy, 3, {True: 300.0, False: 100.0}, 2 + 4 * interval)
    assert decisions[:2] == [True, False]  # speculation measured first, then without
    assert policy.rate(4, True) == pytest.approx(300.0)
    assert policy.rate(4, False) == pytest.approx(100.0)
    later = decisions[2:]
    assert later.count(False) == 4  # probes only, one every `interval` steps
    assert [i for i, on in enumerate(later) if not on] == [interval * j - 1 for j in (1, 2, 3, 4)]


@pytest.mark.parametrize("gap", [1.001, 1.05, 1.3, 2.0, 3.0, 50.0])
def test_probes_cost_about_the_budget_of_throughput(gap):
    """A probe step of the mode ``gap`` times slower costs gap - 1 steps of the faster one's
    time; spaced probe_interval(gap) apart, that is at most PROBE_BUDGET of the time, unless
    the interval is at its floor (modes this close lose little either way) or its cap."""
    interval = probe_interval(gap)
    assert MIN_PROBE_INTERVAL <= interval <= MAX_PROBE_INTERVAL
    cost = (gap - 1.0) / interval
    assert cost <= PROBE_BUDGET * (1 + 1e-9) or interval == MAX_PROBE_INTERVAL
    assert cost >= PROBE_BUDGET / 2 or interval == MIN_PROBE_INTERVAL


def test_buckets_decide_apart_and_a_change_is_followed():
    policy = _policy()
    steps = 3 * probe_interval(2.0)
    _serve(policy, 200, {True: 50.0, False: 100.0}, steps)  # big batch: speculation loses
    assert policy.rate(256, True) < policy.rate(256, False)
    _serve(policy, 2, {True: 300.0, False: 100.0}, steps)  # small batch: it wins
    assert policy.rate(2, True) > policy.rate(2, False)
    assert policy.rate(256, True) < policy.rate(256, False)  # the big bucket kept its own
    # The big batch turns repetitive: speculation now wins there too, seen through the probes.
    decisions = _serve(policy, 200, {True: 400.0, False: 100.0}, 2 * steps)
    tail = decisions[-MIN_PROBE_INTERVAL:]
    assert tail.count(True) >= MIN_PROBE_INTERVAL - 1


def test_always_and_disable_by_batch_size():
    policy = _policy(policy="always", disable_by_batch_size=8)
    assert policy.num_drafts(8) == 4
    assert policy.num_drafts(9) == 0
    assert policy.num_drafts(0) == 0


def test_steps_count_by_their_decode_share():
    """A step spent on prefill chunks (weight 0) leaves the measurements as they were; a half
    decode step counts half, and decays the past by half a step's worth."""
    policy = _policy()
    policy.num_drafts(3)  # speculation measured first
    policy.observe_step(1, 5.0, weight=0.0)  # a prefill step: says nothing
    assert policy.rate(4, True) is None
    policy.observe_step(10, 0.1)
    assert policy.rate(4, True) == pytest.approx(100.0)
    policy.observe_step(10, 0.05, weight=0.5)  # the same decision's next step, half decode
    decay = 0.95**0.5
    assert policy.rate(4, True) == pytest.approx((decay * 10 + 5) / (decay * 0.1 + 0.025))


def test_decode_share_of_a_step():
    # a: decode with 2 drafts (3 tokens), b: a decode, c: a prefill chunk of 6
    num_scheduled = {"a": 3, "b": 1, "c": 6}
    assert decode_share(num_scheduled, {"a": [5, 6]}) == pytest.approx(0.4)
    assert decode_share({}, {}) == 0.0
