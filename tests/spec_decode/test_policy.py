"""The speculation policy: it measures output tokens per second with and without speculation
per batch-size bucket, takes the faster, probes the other, and follows a change."""

from __future__ import annotations

import pytest

from jaxserve.spec_decode.policy import PROBE_EVERY, SpecPolicy
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
    decisions = _serve(policy, 3, {True: 300.0, False: 100.0}, 4 * PROBE_EVERY)
    assert decisions[:2] == [True, False]  # speculation measured first, then without
    assert policy.rate(4, True) == pytest.approx(300.0)
    assert policy.rate(4, False) == pytest.approx(100.0)
    later = decisions[2:]
    assert later.count(False) == len(later) // PROBE_EVERY  # probes only


def test_buckets_decide_apart_and_a_change_is_followed():
    policy = _policy()
    _serve(policy, 200, {True: 50.0, False: 100.0}, 3 * PROBE_EVERY)  # big batch: speculation loses
    assert policy.num_drafts(200) == 0
    _serve(policy, 2, {True: 300.0, False: 100.0}, 3 * PROBE_EVERY)  # small batch: it wins
    assert policy.num_drafts(2) == 4
    assert policy.num_drafts(200) == 0  # the big bucket kept its own measurements
    # The big batch turns repetitive: speculation now wins there too, seen through the probes.
    decisions = _serve(policy, 200, {True: 400.0, False: 100.0}, 6 * PROBE_EVERY)
    assert decisions[-PROBE_EVERY:].count(True) >= PROBE_EVERY - 1


def test_always_and_disable_by_batch_size():
    policy = _policy(policy="always", disable_by_batch_size=8)
    assert policy.num_drafts(8) == 4
    assert policy.num_drafts(9) == 0
    assert policy.num_drafts(0) == 0
