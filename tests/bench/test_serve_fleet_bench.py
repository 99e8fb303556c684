"""bench/serve.py --data-parallel-size / --disagg, host side only (the runs start servers:
too slow for the suite): the multi-turn workload's turns extend each other and fit the model;
the front's summed metrics are read without the per-replica lines."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _serve_fleet  # noqa: E402


def test_each_turn_extends_the_previous_one_and_fits():
    engine = dict(_serve_fleet.BUILTIN_ENGINE)
    convs = _serve_fleet.conversations(5, engine, vocab=1000, seed=0)
    assert len(convs) == 5 and all(len(c) == _serve_fleet.NUM_TURNS for c in convs)
    for turns in convs:
        for (prev, _), (nxt, _) in zip(turns, turns[1:], strict=False):
            assert nxt[: len(prev)] == prev and len(nxt) > len(prev)
        last, max_tokens = turns[-1]
        assert len(last) + max_tokens <= engine["max_model_len"]
    assert convs[0][0][0] != convs[1][0][0]  # conversations differ from their first tokens


def test_metric_sums_skip_the_replica_lines():
    text = (
        'jaxserve:prefix_cache_hits_total{model_name="m",replica="0"} 3.0\n'
        'jaxserve:prefix_cache_hits_total{model_name="m",replica="1"} 4.0\n'
        'jaxserve:prefix_cache_hits_total{model_name="m"} 7.0\n'
    )
    assert _serve_fleet._metric_sum(text, "jaxserve:prefix_cache_hits_total") == 7.0
    assert _serve_fleet._percentiles([1.0, float("nan")])["p50"] == 1.0
    assert _serve_fleet._percentiles([]) == {}


def test_think_times_are_seeded_and_zero_means_lockstep():
    pauses = _serve_fleet.think_times(4, 0.2, seed=0)
    assert pauses == _serve_fleet.think_times(4, 0.2, seed=0)
    assert len(pauses) == 4 and all(len(p) == _serve_fleet.NUM_TURNS for p in pauses)
    assert all(t >= 0 for p in pauses for t in p) and pauses[0] != pauses[1]
    assert _serve_fleet.think_times(2, 0.0, seed=0) == [[0.0] * _serve_fleet.NUM_TURNS] * 2
