"""Smoke test of bench/spec_proposers.py (host only, no model: seconds): the table's rows, the
same requests for both proposers (drafts agree with what a verification would accept), and the
JSON it writes. Never a time or a ratio of times."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import spec_proposers  # noqa: E402


def test_both_proposers_side_by_side(tmp_path):
    out = tmp_path / "spec_proposers.json"
    report = spec_proposers.main(["--batch-sizes", "1,4", "--steps", "30", "--output", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rows = report["rows"]
    assert [(r["workload"], r["batch"], r["method"]) for r in rows] == [
        (w, b, m) for w in ("repetitive", "sharegpt") for b in (1, 4) for m in ("ngram", "suffix")
    ]
    repetitive = [r for r in rows if r["workload"] == "repetitive"]
    assert all(r["drafts_per_step"] > 0 and r["acceptance"] > 0.3 for r in repetitive)
