"""Smoke test of bench/moe_decode.py on its "tiny" preset (no time asserted): both engines run,
the JSON holds a ratio per batch size, and the dense twin has the MoE's active parameter
count (all but the router's D x E per layer)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import moe_decode  # noqa: E402

pytest.importorskip("torch")  # the checkpoints are written with transformers


@pytest.mark.slow  # two engines compile their steps: ~10-30 s on the shared 2-core machine
def test_tiny_preset_end_to_end(tmp_path):
    out = tmp_path / "moe.json"
    report = moe_decode.main(["--preset", "tiny", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    moe, dense = report["runs"]["moe"], report["runs"]["dense"]
    assert set(report["ratio_moe_over_dense"]) == set(report["weight_read_bound"]) == {"2"}
    assert moe["tokens_per_s"]["2"] > 0 and dense["tokens_per_s"]["2"] > 0
    # Tiny preset: D 64, 2 layers, 4 experts of F 32, top-2; the dense MLP is 64 wide.
    assert moe["num_params"] - moe["active_params"] == 2 * (4 - 2) * 3 * 64 * 32
    assert moe["active_params"] - dense["num_params"] == 2 * 64 * 4  # the routers
    assert dense["active_params"] == dense["num_params"]
    # Two tokens reach 4 * (1 - (1 - 2/4) ** 2) = 3 of the 4 experts on average.
    expert = moe["expert_params"]
    assert expert == 2 * 3 * 64 * 32
    read = moe["num_params"] - 4 * expert + 3 * expert
    assert report["weight_read_bound"]["2"] == pytest.approx(dense["num_params"] / read, abs=1e-3)
