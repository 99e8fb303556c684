"""RunAheadPolicy (engine/run_ahead.py): on a clock of its own, it takes the arm measured faster
in each batch bucket, probes the other within its budget, and measures neither the transition
steps nor the steps with prefill chunks."""

from __future__ import annotations

import pytest

from jaxserve.engine.run_ahead import (
    MAX_PROBE_INTERVAL,
    MIN_PROBE_INTERVAL,
    RUN_STEPS,
    RunAheadPolicy,
    probe_interval,
)


def _drive(policy: RunAheadPolicy, steps: int, seconds: dict, running: int = 16) -> list[bool]:
    """``steps`` decode steps of ``running`` requests, each taking ``seconds[arm]``."""
    now, decisions = policy._last_end or 0.0, []
    for _ in range(steps):
        ahead = policy.run_ahead(running)
        decisions.append(ahead)
        now += seconds["ahead" if ahead else "sync"]
        policy.observe(running, decode_only=True, now=now)
    return decisions


@pytest.mark.parametrize("faster", ["ahead", "sync"])
def test_the_faster_arm_runs_and_the_other_is_probed_within_budget(faster):
    policy = RunAheadPolicy()
    slower = {"ahead": "sync", "sync": "ahead"}[faster]
    seconds = {faster: 0.010, slower: 0.0103}  # 3% apart: the 57M model's case
    decisions = _drive(policy, 2000, seconds)
    later = decisions[200:]  # past both arms' first measurements
    share = sum(d == (faster == "ahead") for d in later) / len(later)
    # Probes of RUN_STEPS steps every MIN_PROBE_INTERVAL steps at most.
    assert share >= 1 - RUN_STEPS / MIN_PROBE_INTERVAL - 0.01
    assert share < 1.0  # the other arm is still probed
    assert policy.stats()["async_policy_best_arm"] == {16: faster}


def test_transitions_and_prefill_steps_are_not_measured():
    policy = RunAheadPolicy()
    now = 0.0
    for i in range(RUN_STEPS):
        assert policy.run_ahead(4)  # "ahead" is measured first
        now += 1.0 if i == 0 else 0.01  # the transition step is slow: not counted
        policy.observe(4, decode_only=True, now=now)
    assert policy.rate(4, "ahead") == pytest.approx(400.0)
    policy.run_ahead(4)
    policy.observe(4, decode_only=False, now=now + 5.0)  # a prefill step: not counted
    assert policy.rate(4, "ahead") == pytest.approx(400.0)


def test_batch_buckets_are_measured_apart():
    policy = RunAheadPolicy()
    _drive(policy, 400, {"ahead": 0.01, "sync": 0.02}, running=3)
    _drive(policy, 400, {"ahead": 0.02, "sync": 0.01}, running=200)
    assert policy.stats()["async_policy_best_arm"] == {4: "ahead", 256: "sync"}


def test_probe_interval_spends_the_budget():
    assert probe_interval(1.0) == MIN_PROBE_INTERVAL
    assert probe_interval(1.6, budget=0.01) == RUN_STEPS * 60
    assert probe_interval(100.0) == MAX_PROBE_INTERVAL


def test_sync_must_be_faster_by_the_margin():
    policy = RunAheadPolicy()
    decisions = _drive(policy, 1000, {"ahead": 0.0100, "sync": 0.00995})  # 0.5%: < the margin
    assert policy.stats()["async_policy_best_arm"] == {16: "ahead"}
    assert sum(decisions[200:]) / 800 > 0.85
