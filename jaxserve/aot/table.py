"""The human-readable form of a compile report (CompileReport.as_dict()): one line per
compilation, then the totals and the predictions. Plain strings; the CLI prints them."""

from __future__ import annotations

from typing import Any

GIB = 1 << 30
MIB = 1 << 20


def _size(num_bytes: float | None) -> str:
    if num_bytes is None:
        return "-"
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / MIB:.1f} MiB"


def bucket_line(bucket: dict[str, Any]) -> str:
    """One compilation: label, status, seconds, memory, FLOPs, roofline."""
    label = f"{bucket['label']:<36}"
    seconds = bucket["lower_s"] + bucket["compile_s"]
    if not bucket["ok"]:
        first = (bucket["error"] or "").splitlines()[0][:160]
        return f"{label} FAILED {seconds:6.1f} s  {first}"
    m = bucket["memory"]
    line = (
        f"{label} ok     {seconds:6.1f} s  args {_size(m['argument_size_in_bytes']):>10}  "
        f"temp {_size(m['temp_size_in_bytes']):>10}  alias {_size(m['alias_size_in_bytes']):>10}"
    )
    if bucket["flops"] is not None:
        line += f"  {bucket['flops'] / 1e9:9.2f} GFLOP"
    roofline = bucket.get("roofline")
    if roofline:
        line += f"  {roofline['seconds'] * 1e3:8.3f} ms ({roofline['bound']})"
    return line


def format_report(report: dict[str, Any]) -> str:
    """The whole report as text: header, one line per compilation, summary."""
    buckets = [bucket_line(b) for b in report["buckets"]]
    return "\n".join([*header_lines(report), "", *buckets, "", *summary_lines(report)])


def header_lines(report: dict[str, Any]) -> list[str]:
    """The model, the target and the plan."""
    target, plan = report["target"], report["plan"]
    soft = " (e4m3 pages converted with integer ops)" if plan.get("attention_soft_fp8") else ""
    return [
        f"jaxserve compile: {report['model']} for {target['name']} ({target['device_kind']}, "
        f"{_size(target['memory_bytes'])} per chip)",
        f"plan: attention={plan['attention']}{soft}, dtype={plan['dtype']}, "
        f"kv_cache_dtype={plan['kv_cache_dtype']}, tensor_parallel_size="
        f"{plan['tensor_parallel_size']}, KV pool {report['memory_plan']['num_kv_blocks']} blocks",
    ]


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The totals and the predictions."""
    return [*_total_lines(report["totals"]), *_prediction_lines(report)]


def _total_lines(totals: dict[str, Any]) -> list[str]:
    ratio = totals["compiled_over_planned"]
    verdict = "OK" if totals["ok"] else "NOT OK"
    return [
        f"compilations: {totals['num_compilations']}, failed {totals['num_failed']}, "
        f"{totals['compile_seconds']:.1f} s",
        f"memory per device: compiled peak {_size(totals['compiled_peak_bytes'])}, planned "
        f"{_size(totals['planned_bytes'])}"
        + ("" if ratio is None else f" (compiled / planned {ratio:.3f})")
        + f"; largest temporaries {_size(totals['max_temp_bytes'])} vs workspace reserve "
        f"{_size(totals['planned_workspace_bytes'])}",
        f"device memory planned with {_size(totals['device_memory_bytes'])} (chip "
        f"{_size(totals['chip_memory_bytes'])})",
        f"fits: {totals['fits']}; KV pages aliased (donated) in every compilation: "
        f"{totals['kv_aliased']}; verdict: {verdict}",
    ]


def _prediction_lines(report: dict[str, Any]) -> list[str]:
    predicted = report["predicted"]
    lines = []
    decode, prefill = predicted["decode"], predicted["prefill"]
    if decode:
        lines.append(
            f"predicted decode (roofline): {decode['tokens_per_s']:,.0f} tok/s, "
            f"{decode['tokens']} sequences at {report['decode_context']} tokens of context, "
            f"{decode['seconds'] * 1e3:.2f} ms/step ({decode['bound']}-bound)"
        )
    if prefill:
        lines.append(
            f"predicted prefill (roofline): {prefill['tokens_per_s']:,.0f} tok/s, chunks of "
            f"{prefill['tokens']} tokens, {prefill['seconds'] * 1e3:.2f} ms/step "
            f"({prefill['bound']}-bound)"
        )
    return lines
