"""The speculation policy's cost model: it speculates where the measured step costs and
acceptance say it gains, stops where it would lose, probes while off, and resumes."""

from __future__ import annotations

import pytest

from jaxserve.spec_decode.policy import PROBE_EVERY, SpecPolicy
from jaxserve.speculative_config import SpeculativeConfig


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _policy(**kw) -> SpecPolicy:
    return SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4, **kw), _pow2)


def _feed(policy: SpecPolicy, cost, accepted_per_draft: float, sizes=(1, 4, 16, 64, 256, 1024)):
    for _ in range(30):
        for tokens in sizes:
            policy.observe_step(tokens, cost(_pow2(tokens)))
        policy.observe_drafts(10, 40)
        policy.observe_acceptance(40, int(40 * accepted_per_draft))


def test_speculates_until_it_has_measurements():
    policy = _policy()
    assert policy.step_cost(16) is None
    assert policy.num_drafts(256) == 4


def test_costs_are_kept_by_bucket_and_interpolated():
    policy = _policy()
    policy.observe_step(3, 1.0)  # bucket 4
    policy.observe_step(60, 3.0)  # bucket 64
    assert policy.step_cost(4) == policy.step_cost(2) == pytest.approx(1.0)
    assert policy.step_cost(16) == pytest.approx(1.0 + 2.0 * (16 - 4) / (64 - 4))
    assert policy.step_cost(128) == pytest.approx(6.0)  # in proportion above the largest
    assert policy.step_cost(1) == pytest.approx(1.0)  # no cheaper than the smallest known


def test_small_batches_speculate_and_compute_bound_batches_do_not():
    policy = _policy()
    # A step costs 10 ms plus 0.1 ms a token: nearly flat at batch 1, proportional at 256.
    _feed(policy, lambda t: 0.010 + 0.0001 * t, accepted_per_draft=0.5)
    assert policy.accepted_per_draft == pytest.approx(0.5, abs=0.03)  # a decayed mean
    gain = 1 + policy.accepted_per_draft * 4
    # batch 1: bucket 1 without drafts; 5 tokens (bucket 8, between 4 and 16) with them
    assert policy.expected_speedup(1) == pytest.approx(gain * 0.0101 / 0.0108, rel=1e-3)
    assert policy.num_drafts(1) == 4
    assert policy.expected_speedup(256) < 1.0
    decisions = [policy.num_drafts(256) for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(4) == 2  # probes only
    assert policy.num_drafts(2) == 4  # the batch shrank: back on


def test_always_and_disable_by_batch_size():
    policy = _policy(policy="always", disable_by_batch_size=8)
    _feed(policy, lambda t: 0.0001 * t, accepted_per_draft=0.0)
    assert policy.num_drafts(8) == 4
    assert policy.num_drafts(9) == 0
    assert policy.num_drafts(0) == 0
