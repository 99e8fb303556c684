"""Tabulate `jaxserve compile --json` reports (bench/aot_check.sh writes them): one row per
report with the target, tensor parallelism, compile status and time, the compiled memory per
device against the memory plan and the chip (and the compilation at the peak), KV aliasing,
and the roofline predictions.

    python bench/aot_report.py REPORT.json... [--markdown TABLE.md]
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

GIB = 1 << 30
COLUMNS = (
    "target",
    "tp",
    "compiled",
    "compile s",
    "compiled peak GiB / device",
    "peak at",
    "planned GiB",
    "compiled / planned",
    "max temp GiB (reserve)",
    "chip GiB",
    "fits",
    "KV aliased",
    "decode tok/s (batch @ ctx)",
    "prefill tok/s (chunk)",
)


def row(report: dict[str, Any]) -> list[str]:
    totals, target = report["totals"], report["target"]
    decode, prefill = report["predicted"]["decode"], report["predicted"]["prefill"]
    ok = totals["num_compilations"] - totals["num_failed"]
    peak = totals["compiled_peak_bytes"]
    ratio, temp = totals["compiled_over_planned"], totals["max_temp_bytes"]
    reserve = totals["planned_workspace_bytes"] / GIB
    return [
        target["name"],
        str(report["plan"]["tensor_parallel_size"]),
        f"{ok}/{totals['num_compilations']}",
        f"{totals['compile_seconds']:.0f}",
        "-" if peak is None else f"{peak / GIB:.2f}",
        peak_label(report),
        f"{totals['planned_bytes'] / GIB:.2f}",
        "-" if ratio is None else f"{ratio:.3f}",
        "-" if temp is None else f"{temp / GIB:.2f} ({reserve:.2f})",
        f"{target['memory_bytes'] / GIB:.0f}",
        "yes" if totals["fits"] else "NO",
        "yes" if totals["kv_aliased"] else "NO",
        "-"
        if decode is None
        else f"{decode['tokens_per_s']:,.0f} ({decode['tokens']} @ {report['decode_context']})",
        "-" if prefill is None else f"{prefill['tokens_per_s']:,.0f} ({prefill['tokens']})",
    ]


def peak_label(report: dict[str, Any]) -> str:
    """The compilation whose live bytes (resident weights and pages included) are the peak."""
    live = [b for b in report["buckets"] if b.get("live_bytes") is not None]
    return max(live, key=lambda b: b["live_bytes"])["label"] if live else "-"


def markdown(reports: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in reports]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=pathlib.Path)
    parser.add_argument("--markdown", type=pathlib.Path, help="also write the table here")
    args = parser.parse_args()
    reports = [json.loads(p.read_text()) for p in args.reports]
    table = markdown(reports)
    print(table)
    for r in reports:
        for b in r["buckets"]:
            if not b["ok"]:
                print(f"{r['target']['name']}: {b['label']} FAILED: {b['error'][:300]}")
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
