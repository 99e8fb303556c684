"""bench/serve.py's report: SLO brackets and the rate search, the comparison of the
servers, the goals, the table and the plot."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import aiohttp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _serve_presets import GOAL_RATE_RATIO, GOAL_SERVED_OVER_OFFLINE, INF, TTFT_SLO_S  # noqa: E402


def _log_facts(log: str) -> dict:
    """A few lines of a server log worth keeping: its KV size and warm-up."""
    facts = {}
    for key, pattern in (
        ("kv_cache", r"KV cache size:[^\n]*|KV blocks of[^\n]*"),
        ("warmup", r"warm-up:[^\n]*"),
        ("omp_threads", r"core ids=[^\n]*"),
    ):
        found = re.findall(pattern, log)
        if found:
            facts[key] = found[-1].strip()[:300]
    return facts


def _client_version() -> str:
    return f"aiohttp {aiohttp.__version__}"


def _saturation_key(j: int) -> str:
    return f"saturation-{j}"


def _by_rate(runs: list[dict]) -> dict[float, dict]:
    """Runs by rate; of several at one rate (the saturation pairs), the first."""
    out: dict[float, dict] = {}
    for r in runs:
        out.setdefault(r["rate"], r)
    return out


def _runs(report: dict, server: str) -> dict[float, dict]:
    info = report["servers"].get(server) or {}
    return _by_rate(info.get("runs", []))


def meets_slo(s: dict) -> bool:
    """Every request completed and p99 TTFT <= the SLO."""
    p99 = s["ttft_ms_p99"]
    return s["failed"] == 0 and p99 is not None and p99 <= TTFT_SLO_S * 1e3


def slo_bracket(runs: dict[float, dict]) -> tuple[float | None, float | None]:
    """(lo, hi): hi the lowest rate tested (inf included) that misses the SLO, lo the highest
    tested below hi that meets it; None where there is none."""
    missed = [rate for rate, s in runs.items() if not meets_slo(s)]
    hi = min(missed) if missed else None
    met = [rate for rate, s in runs.items() if meets_slo(s) and (hi is None or rate < hi)]
    return (max(met) if met else None), hi


def sustained_rate(runs: dict[float, dict]) -> float | None:
    """The highest rate tested at which the SLO holds, and holds at every lower rate tested (a
    noisy pass above a miss does not count)."""
    return slo_bracket(runs)[0]


SEARCH_REL_TOL = 0.03  # stop bisecting once the bracket is this narrow


def next_search_rate(runs: dict[float, dict]) -> float | None:
    """The next rate of the bisection for sustained_rate (three significant digits): the middle
    of slo_bracket, twice lo while only inf missed, half hi while nothing met; None once the
    bracket is narrower than SEARCH_REL_TOL, or nothing missed, or no finite rate was run."""
    lo, hi = slo_bracket(runs)
    if hi is None or (lo is None and not math.isfinite(hi)):
        return None  # met everywhere (nothing to find), or only all-at-once was run
    if lo is None:
        mid = hi / 2
    elif not math.isfinite(hi):
        mid = 2 * lo
    elif hi / lo - 1 <= SEARCH_REL_TOL:
        return None
    else:
        mid = (lo + hi) / 2
    mid = float(f"{mid:.3g}")
    if mid in runs or mid <= (lo or 0.0) or mid >= hi:
        return None  # rounding reached the bracket's ends
    return mid


def compare(report: dict) -> dict:
    js, vl = _runs(report, "jaxserve"), _runs(report, "vllm")
    every = {name: _runs(report, name) for name in report["servers"]}
    out: dict = {
        "sustained_rate": {name: sustained_rate(runs) for name, runs in every.items() if runs},
        "per_rate": [],
        "async_over_sync": _async_over_sync(js, every.get("jaxserve-sync") or {}),
    }
    for rate in sorted(set(js) & set(vl)):
        a, b = js[rate], vl[rate]
        row = {"rate": rate}
        for key in (
            "ttft_ms_p99",
            "itl_ms_p99",
            "ttft_ms_p50",
            "itl_ms_p50",
            "output_tokens_per_s",
        ):
            if a.get(key) is not None and b.get(key):
                row[f"{key}_jaxserve/vllm"] = a[key] / b[key]
        row["jaxserve_ttft_p99_no_worse"] = _no_worse(a, b, "ttft_ms_p99")
        row["jaxserve_itl_p99_no_worse"] = _no_worse(a, b, "itl_ms_p99")
        out["per_rate"].append(row)
    sat = js.get(INF)
    off = report.get("offline") or {}
    pairs = report["servers"].get("jaxserve", {}).get("overhead_pairs")
    if pairs:
        ratios = [p["ratio"] for p in pairs]
        out["served_saturation_over_offline"] = float(np.median(ratios))
        out["served_saturation_over_offline_pairs"] = ratios
    elif sat and off.get("output_tokens_per_s"):
        out["served_saturation_over_offline"] = (
            sat["output_tokens_per_s"] / off["output_tokens_per_s"]
        )
    return out


def _async_over_sync(on: dict[float, dict], off: dict[float, dict]) -> list[dict]:
    """Per rate both ran: jaxserve with async scheduling (the "jaxserve" server, on by the
    plan on every platform) over "jaxserve-sync" (--no-async-scheduling), side by side."""
    rows = []
    for rate in sorted(set(on) & set(off)):
        row = {"rate": rate}
        for key in ("output_tokens_per_s", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"):
            if on[rate].get(key) is not None and off[rate].get(key):
                row[key] = on[rate][key] / off[rate][key]
        rows.append(row)
    return rows


def _no_worse(a: dict, b: dict, key: str) -> bool | None:
    if a.get(key) is None or b.get(key) is None:
        return None
    return a[key] <= b[key]


def goals(report: dict) -> list[dict]:
    """The issue's goals: value, threshold, and whether it holds (None: not measured)."""
    out = []

    def goal(text: str, value, threshold: float, higher: bool = True) -> None:
        holds = None
        if value is not None:
            holds = bool(value >= threshold if higher else value <= threshold)
        out.append(
            {
                "goal": text,
                "value": value,
                "threshold": threshold,
                "direction": ">=" if higher else "<=",
                "pass": holds,
            }
        )

    c = report["comparison"]
    goal(
        "jaxserve served output tok/s at saturation / offline LLM.generate (median of pairs)",
        c.get("served_saturation_over_offline"),
        GOAL_SERVED_OVER_OFFLINE,
    )
    rates = c["sustained_rate"]
    ratio = None
    if "jaxserve" in rates and "vllm" in rates:
        j, v = rates["jaxserve"], rates["vllm"]
        if v:
            ratio = (j or 0.0) / v
        elif j:
            ratio = INF  # vLLM met the SLO at no rate tested, jaxserve at some
    goal(
        f"sustained rate (p99 TTFT <= {TTFT_SLO_S:g} s there and below): jaxserve / vLLM",
        ratio,
        GOAL_RATE_RATIO,
    )
    for row in c["per_rate"]:
        r = _rate_str(row["rate"])
        goal(
            f"rate {r}: jaxserve p99 TTFT / vLLM's",
            row.get("ttft_ms_p99_jaxserve/vllm"),
            1.0,
            higher=False,
        )
        goal(
            f"rate {r}: jaxserve p99 ITL / vLLM's",
            row.get("itl_ms_p99_jaxserve/vllm"),
            1.0,
            higher=False,
        )
    return out


def _json_safe(x):
    """inf / nan -> "inf" / null (strict JSON)."""
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, dict):
        return {(_rate_str(k) if isinstance(k, float) else k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _rate_str(rate) -> str:
    if rate in (INF, "inf"):
        return "inf"
    return f"{rate:g}"


def _ms(v) -> str:
    return f"{v:8.1f}" if v is not None else f"{'-':>8s}"


def _num(v, width: int = 6, digits: int = 2) -> str:
    if v is None:
        return f"{'-':>{width}s}"
    if v == INF or v == "inf":
        return f"{'inf':>{width}s}"
    return f"{v:{width}.{digits}f}"


def print_table(report: dict) -> None:
    _print_runs(report)
    _print_comparison(report)
    for note in report["notes"]:
        print(f"note: {note}")
    print("goals:")
    for g in report["goals"]:
        mark = {True: "OK  ", False: "MISS", None: " -- "}[g["pass"]]
        value = "not measured" if g["value"] is None else _num(g["value"], 1, 3).strip()
        print(f"  [{mark}] {g['goal']} {g['direction']} {g['threshold']:g}: {value}")


def _print_runs(report: dict) -> None:
    """The settings line and one row per server and rate run."""
    s = report["settings"]
    m = s["model"]
    params = f"{m['num_params'] / 1e6:.1f}M params, " if m["num_params"] else ""
    print(
        f"\nmodel {m['name']} ({params}fp32), {s['num_requests']} requests a rate "
        f"(ShareGPT-like: mean in {s['dataset']['prompt_len_mean']:.0f}, out "
        f"{s['dataset']['output_len_mean']:.0f} tokens), {report['machine']['cpus']} cores, "
        f"load avg start {report['machine']['loadavg']['start']} end "
        f"{report['machine']['loadavg'].get('end')}"
    )
    head = (
        f"{'server':13s} {'rate':>6s} {'ok':>7s} {'req/s':>6s} {'out tok/s':>9s} "
        f"{'ttft p50':>8s} {'ttft p99':>8s} {'itl p50':>8s} {'itl p99':>8s} "
        f"{'e2e p50':>8s} {'e2e p99':>8s} {'tok/chk':>7s}"
    )
    print(head + "\n" + "-" * len(head))
    for name, info in report["servers"].items():
        if info.get("skipped"):
            print(f"{name:13s} skipped: {info['skipped']}")
            continue
        runs = sorted(info.get("runs", []), key=lambda r: r["rate"])
        for r in runs:
            rate = _rate_str(r["rate"]) + ("*" if r.get("search") else "")
            print(
                f"{name:13s} {rate:>6s} "
                f"{r['tokens_match']:>3d}/{r['num_requests']:<3d} {_num(r['requests_per_s'])} "
                f"{_num(r['output_tokens_per_s'], 9, 1)} {_ms(r['ttft_ms_p50'])} "
                f"{_ms(r['ttft_ms_p99'])} {_ms(r['itl_ms_p50'])} {_ms(r['itl_ms_p99'])} "
                f"{_ms(r['e2e_ms_p50'])} {_ms(r['e2e_ms_p99'])} {_num(r['tokens_per_chunk'], 7)}"
            )
        if info.get("error"):
            print(f"{name:13s} FAILED: {info['error'][:300]}")
    print(
        "(times in ms; ok = requests that got exactly the tokens asked for; * a run of the "
        "sustained-rate search)"
    )


def _print_comparison(report: dict) -> None:
    """Served against offline, each server's sustained rate, and jaxserve / vLLM per rate."""
    off = report.get("offline") or {}
    c = report["comparison"]
    if off.get("output_tokens_per_s"):
        ratio = c.get("served_saturation_over_offline")
        pairs = c.get("served_saturation_over_offline_pairs") or []
        print(
            f"offline jaxserve LLM.generate: {off['output_tokens_per_s']:.1f} out tok/s "
            f"({off['requests_per_s']:.2f} req/s, first run); served at saturation / offline: "
            f"{_num(ratio, 1, 2).strip()}"
            + (f" (median of {' '.join(f'{r:.2f}' for r in pairs)})" if len(pairs) > 1 else "")
        )
    rates = c["sustained_rate"]
    print(
        f"sustained rate (p99 TTFT <= {TTFT_SLO_S:g} s there and at every lower rate run): "
        + ", ".join(f"{k} {_rate_str(v) if v is not None else 'none'}" for k, v in rates.items())
    )
    for row in c["per_rate"]:
        print(
            f"  rate {_rate_str(row['rate']):>5s}: jaxserve/vLLM p99 TTFT "
            f"{_num(row.get('ttft_ms_p99_jaxserve/vllm'), 5)}, p99 ITL "
            f"{_num(row.get('itl_ms_p99_jaxserve/vllm'), 5)}, out tok/s "
            f"{_num(row.get('output_tokens_per_s_jaxserve/vllm'), 5)}"
        )
    for row in c.get("async_over_sync") or []:
        print(
            f"  rate {_rate_str(row['rate']):>5s}: async / sync scheduling out tok/s "
            f"{_num(row.get('output_tokens_per_s'), 5)}, p99 TTFT "
            f"{_num(row.get('ttft_ms_p99'), 5)}, p50 ITL {_num(row.get('itl_ms_p50'), 5)}, "
            f"p99 ITL {_num(row.get('itl_ms_p99'), 5)}"
        )


# ---- plot -----------------------------------------------------------------------------------


def plot(report: dict, output: Path) -> Path:
    """p99 TTFT and output tok/s against the request rate, one line per server; the saturation
    run drawn at the right edge ("inf")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"jaxserve": "#1f77b4", "vllm": "#d62728"}
    finite = [
        r["rate"]
        for info in report["servers"].values()
        for r in info.get("runs", [])
        if r["rate"] not in (INF, "inf")
    ]
    grid = [r for r in report["settings"]["rates"] or [] if r not in (INF, "inf")]
    inf_x = (max(finite) * 1.3) if finite else 1.0
    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(12, 4.6))
    for name, info in report["servers"].items():
        runs = info.get("runs") or []
        if not runs:
            continue
        pts = sorted(((inf_x if r["rate"] in (INF, "inf") else r["rate"]), r) for r in runs)
        xs = [x for x, _ in pts]
        ttft = [(r["ttft_ms_p99"] or math.nan) / 1e3 for _, r in pts]
        tput = [r["output_tokens_per_s"] or math.nan for _, r in pts]
        c = colors.get(name)
        ax_t.plot(xs, ttft, "o-", color=c, label=name)
        ax_p.plot(xs, tput, "o-", color=c, label=name)
    off = report.get("offline") or {}
    if off.get("output_tokens_per_s"):
        ax_p.axhline(off["output_tokens_per_s"], color="#1f77b4", ls=":", label="jaxserve offline")
    ax_t.axhline(TTFT_SLO_S, color="gray", ls="--", lw=1, label=f"{TTFT_SLO_S:g} s")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("p99 TTFT (s)")
    ax_p.set_ylabel("output tokens/s")
    for ax in (ax_t, ax_p):
        ax.set_xlabel("request rate (req/s); rightmost: all at once")
        ticks = sorted(set(grid)) + [inf_x]  # the search's rates are points between them
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks[:-1]] + ["inf"])
        ax.grid(alpha=0.3)
        ax.legend()
    m = report["settings"]["model"]
    fig.suptitle(
        f"bench/serve.py: {m['name']}, {report['settings']['num_requests']} ShareGPT-like "
        f"requests a rate, {report['machine']['cpus']} CPU cores ({report['time']})",
        fontsize=10,
    )
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
