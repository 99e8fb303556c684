"""bench/startup.py's printed report: one table, the first and second process side by side."""

from __future__ import annotations

from pathlib import Path

from _startup_phases import print_phases
from _startup_server import print_server


def _r(v: float | None, width: int = 9, digits: int = 2) -> str:
    return f"{v:{width}.{digits}f}" if v is not None else f"{'-':>{width}}"


def print_report(r: dict) -> None:
    m = r["machine"]
    print(
        f"\nstart-up benchmark, preset {r['preset']}: {m['cpu_count']} CPU cores, jax "
        f"{m['jax']} ({m['jax_backend']}), load {m['loadavg']['start']} -> {m['loadavg']['end']}"
    )
    head = f"{'measurement':44s} {'first':>9s} {'second':>9s} {'ratio':>7s}"
    print(head)
    print("-" * len(head))
    sections = {"demo": _print_demo, "construct": _print_construct, "workers": _print_workers,
                "features": _print_features, "phases": print_phases,
                "server": _print_servers, "demo57m": _print_demo}  # fmt: skip
    for name, section in sections.items():
        if name in r:
            section(r[name])
    print("goals:")
    for g in r["goals"].values():
        mark = "PASS" if g["passed"] else "MISS"
        note = f"  ({g['note']})" if g.get("note") else ""
        value = f"{g['value']:.3g} (threshold {g['op']} {g['threshold']:.3g})"
        print(f"  [{mark}] {g['goal']}: {value}{note}")


def _row(label: str, a, b, ratio: float | None = None, digits: int = 2) -> None:
    """One line of the report's table: the first and second value, and their ratio if given."""
    ratio_s = f"{ratio:7.2f}" if ratio is not None else f"{'':7s}"
    print(f"{label:44s} {_r(a, 9, digits)} {_r(b, 9, digits)} {ratio_s}")


def _print_demo(d: dict) -> None:
    """Section 1: the generate demo, two processes sharing one compile cache."""
    a, b = d["runs"]
    command = " ".join(Path(x).name if "/" in x else x for x in d["command"])
    print(f"{d.get('number', 1)} {command}, two processes, one cache")
    _row("  wall s (spawn to exit)", a["wall_s"], b["wall_s"], d["wall_ratio"])
    _row("  warm-up s", a["warmup"]["warmup_s"], b["warmup"]["warmup_s"])
    if "weights_s" in a:  # the weight load (its thread), overlapped with a handed job's warm-up
        _row("  weight load s", a["weights_s"], b["weights_s"])
    _row("  engine: fresh compilations", a["engine"]["fresh"], b["engine"]["fresh"], digits=0)
    _row("  engine: cache hits", a["engine"]["cache_hits"], b["engine"]["cache_hits"], digits=0)
    _row("  process-wide: fresh", a["process"]["fresh"], b["process"]["fresh"], digits=0)
    _row(
        "  process-wide: cache hits",
        a["process"]["cache_hits"],
        b["process"]["cache_hits"],
        digits=0,
    )


def _print_construct(c: dict) -> None:
    """Section 2: LLM(...) construction with warm-up, two processes sharing one cache."""
    a, b = c["runs"]
    print(f"2 LLM({Path(c['engine']['model']).name}, warmup=True), two processes, one cache")
    _row("  construct s", a["construct_s"], b["construct_s"], c["construct_ratio"])
    _row(
        "  of which warm-up s", a["warmup"]["warmup_s"], b["warmup"]["warmup_s"], c["warmup_ratio"]
    )
    _row(
        "  warm-up: in XLA compile / cache load s",
        a["warmup"]["compile_s"],
        b["warmup"]["compile_s"],
    )
    _row("  wall s (spawn to exit)", a["wall_s"], b["wall_s"], c["wall_ratio"])
    _row("  engine: fresh compilations", a["engine"]["fresh"], b["engine"]["fresh"], digits=0)
    _row("  engine: cache hits", a["engine"]["cache_hits"], b["engine"]["cache_hits"], digits=0)
    _row("  process-wide: fresh", a["process"]["fresh"], b["process"]["fresh"], digits=0)
    _row("  weights s (load thread)", a.get("weights_s"), b.get("weights_s"))
    mean = c.get("restart", {}).get("construct_s_mean", {})
    if len(mean) == 2:
        print("  restarted (second process), construct s, mean of "
              f"{len(c['restart']['runs']['overlapped'])}: weights first, then compiled / "
              "weights loading while the executables load")  # fmt: skip
        _row("    weights first / overlapped", mean["weights_first"], mean["overlapped"],
             c["overlap_ratio"])  # fmt: skip


def _print_workers(w: dict) -> None:
    """Section 3: the first warm-up with one compile worker against several."""
    n = w["workers"]
    mean = w["warmup_s_mean"]
    print(
        f"3 first warm-up, workers=1 (first) vs workers={n} (second), {w['cpu_count']} CPU cores, "
        f"{len(w['order']) // 2} run(s) each"
    )
    _row("  warm-up s (mean)", mean["1"], mean[str(n)], mean[str(n)] / mean["1"])
    _row(
        "  compilations",
        w["runs"]["1"][0]["engine"]["compilations"],
        w["runs"][str(n)][0]["engine"]["compilations"],
        digits=0,
    )
    print(f"  speedup workers={n} over workers=1: {w['speedup']:.2f}x")


def _print_features(f: dict) -> None:
    """Section 4: the compilations each SamplingParams feature costs after warm-up."""
    print("4 compilations after warm-up, per SamplingParams feature (tiny-random-llama)")
    head4 = f"  {'feature':46s} {'fresh':>5s} {'hits':>5s} {'proc':>5s} {'tokens':>6s}"
    print(head4)
    for name, x in f["features"].items():
        print(
            f"  {name:46s} {x['fresh']:5d} {x['cache_hits']:5d} {x['process']['fresh']:5d} "
            f"{x['output_tokens']:6d}"
        )
    print("  (proc: fresh XLA compilations of anything in the process)")


def _print_servers(servers: dict) -> None:
    """Section 6, per model."""
    for name, s in servers.items():
        print(f"[{name}]")
        print_server(s)
