"""Smoke test of bench/structured.py on the demo model, a handful of short requests (no time
asserted): every fraction ran in every mode with the same tokens, the masks of the overlapped
mode were built after its forward halves were dispatched, nothing compiled after warm-up."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import structured  # noqa: E402


def test_demo_model_every_mode(tmp_path):
    out = tmp_path / "structured.json"
    args = ["--num-requests", "3", "--max-tokens", "8", "--prompt-len", "4", "--max-num-seqs",
            "4", "--max-num-batched-tokens", "4", "--max-model-len", "32", "--repeats", "1",
            "--fractions", "0,1", "--output", str(out)]  # fmt: skip
    result = structured.main(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = {(r["fraction_constrained"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(f, m) for f in (0.0, 1.0) for m in structured.MODES}
    assert all(r["same_tokens"] and r["output_tok_per_s"] > 0 for r in rows.values())
    assert rows[(1.0, "overlapped")]["constrained"] == 3
    assert rows[(0.0, "sync")]["constrained"] == 0
    # Masks are built only for constrained rows; overlapped, after the forward is dispatched.
    assert rows[(1.0, "overlapped")]["masks_ms_per_step"] > 0.0
    assert rows[(0.0, "overlapped")]["masks_ms_per_step"] == 0.0
    # CPU per step, all threads (os.times: 10 ms ticks, may read 0) and the engine thread's.
    assert all(r["cpu_ms_per_step"] >= 0.0 for r in rows.values())
    assert all(r["engine_thread_cpu_ms_per_step"] > 0.0 for r in rows.values())
    # One round: the round's ratio is the rows' ratio; 1.0 for the unconstrained row itself.
    for m in structured.MODES:
        plain, constrained = rows[(0.0, m)], rows[(1.0, m)]
        assert plain["vs_unconstrained_rounds"] == 1.0
        ratio = plain["wall_s"] / constrained["wall_s"]
        assert constrained["vs_unconstrained_rounds"] == pytest.approx(ratio)
        assert constrained["vs_unconstrained"] == pytest.approx(ratio)
    assert result["recompilations_after_warmup"] == []
