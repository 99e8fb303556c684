"""bench/attention_kernel.py's recorder: prints each result row, rewrites the JSON after it and
summarizes the rows per backend.
"""

from __future__ import annotations

import json
import math


class Recorder:
    """Prints each result row and rewrites the JSON after it, so a run cut short by a time
    limit still leaves every row measured so far."""

    def __init__(self, header: dict, out: str | None, copies: dict[str, float]) -> None:
        # The faster probe is the device's copy bandwidth; a "memcpy" over twice the
        # elementwise stream would be a copy that did not happen (an alias), not a bandwidth.
        copy_bps = copies["elementwise"]
        if copies.get("memcpy", 0.0) <= 2 * copy_bps:
            copy_bps = max(copy_bps, copies.get("memcpy", 0.0))
        self.result = dict(
            header,
            copy_Bps=copy_bps,
            copy_elementwise_Bps=copies["elementwise"],
            copy_memcpy_Bps=copies.get("memcpy"),
            complete=False,
            cases=[],
        )
        self.out = out
        self.copy_bps = copy_bps
        probes = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in copies.items())
        print(f"device-to-device copy: {copy_bps / 1e9:.1f} GB/s (read + write; {probes})")
        print(_HEADER)

    def add(self, row: dict) -> None:
        if "achieved_Bps" in row:
            row["fraction_of_copy"] = row["achieved_Bps"] / self.copy_bps
        self.result["cases"].append(row)
        print(_format_row(row, self.copy_bps), flush=True)
        self.save()

    def finish(self) -> dict:
        self.result["summary"] = summarize(self.result["cases"])
        self.result["complete"] = True
        self.save()
        return self.result

    def save(self) -> None:
        if self.out:
            with open(self.out, "w") as f:
                json.dump(self.result, f, indent=1)


def summarize(cases: list[dict]) -> dict:
    """Per backend: its decode rows' best achieved bytes/s and fraction of the copy, per page
    size, and its error count."""
    out: dict[str, dict] = {}
    for row in cases:
        entry = out.setdefault(row["backend"], {"impl": row.get("impl"), "errors": 0, "decode": {}})
        if "error" in row:
            entry["errors"] += 1
        elif row["kind"] == "decode" and "achieved_Bps" in row:
            best = entry["decode"].setdefault(str(row["page_size"]), {"achieved_Bps": 0.0})
            if row["achieved_Bps"] > best["achieved_Bps"]:
                best.update(
                    achieved_Bps=row["achieved_Bps"],
                    fraction_of_copy=row["fraction_of_copy"],
                    batch=row["batch"],
                    context=row["context"],
                )
    return out


_HEADER = (
    f"{'case':30} {'backend':18} {'P':>3} {'batch':>5} {'context':>7} {'kernel us':>10} "
    f"{'GB/s':>8} {'%copy':>6} {'ref us':>10} {'speedup':>8} {'max err':>8}"
)


def _format_row(row: dict, copy_bps: float) -> str:
    head = (
        f"{row['kind']:30} {row['backend']:18} {row['page_size']:>3} {row['batch']:>5} "
        f"{row['context']:>7}"
    )
    if "skipped" in row:
        return f"{head}  skipped: {row['skipped']}"
    if "error" in row:
        return f"{head}  ERROR ({row['error_stage']}): {row['error'][:200]}"
    ref = row.get("reference_s", math.nan)
    flag = "  MISMATCH" if row.get("mismatch") else ""
    return (
        f"{head} {row['kernel_s'] * 1e6:>10.1f} {row['achieved_Bps'] / 1e9:>8.1f} "
        f"{100 * row['achieved_Bps'] / copy_bps:>6.1f} {ref * 1e6:>10.1f} "
        f"{row.get('speedup', math.nan):>8.2f} {row.get('max_abs_err', math.nan):>8.1e}{flag}"
    )
