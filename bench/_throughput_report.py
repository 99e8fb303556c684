"""bench/throughput.py's summaries (per engine, the ratios between engines, prefix caching on /
off), its goals and the table it prints.
"""

from __future__ import annotations


def mean_summary(summaries: list[dict]) -> dict:
    """Numeric fields averaged over repeated runs (bracketing); the runs' output tokens/s kept."""
    if len(summaries) == 1:
        return dict(summaries[0], num_runs=1)
    out = dict(summaries[-1])
    for k in summaries[0]:
        vals = [s.get(k) for s in summaries]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals):
            out[k] = sum(vals) / len(vals)
    out["num_runs"] = len(summaries)
    out["runs_output_tokens_per_s"] = [s["output_tokens_per_s"] for s in summaries]
    return out


def ratios(engines: dict) -> dict:
    """jaxserve's output tokens/s over each other engine's (x > 1: jaxserve faster)."""
    if "jaxserve" not in engines:
        return {}
    ours = engines["jaxserve"]["output_tokens_per_s"]
    return {
        f"jaxserve/{e}": ours / s["output_tokens_per_s"]
        for e, s in engines.items()
        if e != "jaxserve"
    }


def cache_on_off(engines: dict) -> dict:
    """Prefix caching on / off: output tokens/s of each engine with it on over with it off, and
    jaxserve's work ratio (model FLOPs off / on: the speedup if every token cost the same)."""
    out = {}
    for on, off in (("jaxserve", "jaxserve-nocache"), ("vllm", "vllm-nocache")):
        if on in engines and off in engines:
            out[on] = engines[on]["output_tokens_per_s"] / engines[off]["output_tokens_per_s"]
    js, nc = engines.get("jaxserve", {}), engines.get("jaxserve-nocache", {})
    if js.get("model_flops") and nc.get("model_flops"):
        out["work_ratio"] = nc["model_flops"] / js["model_flops"]
    return out


def versions() -> dict:
    import jax

    out = {"jax": jax.__version__}
    for mod in ("torch", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


def goals(report: dict) -> list[dict]:
    """The issue's goals, each with its measured value and whether it holds."""
    out = []

    def goal(text: str, value, target: float, higher: bool = True) -> None:
        if value is None:
            return
        holds = value >= target if higher else value <= target
        out.append({"goal": text, "target": target, "measured": value, "holds": bool(holds)})

    sg = report["datasets"].get("sharegpt")
    if sg:
        r, e = sg["ratios"], sg["engines"]
        goal("sharegpt: jaxserve / vllm output tok/s >= 1.5", r.get("jaxserve/vllm"), 1.5)
        goal("sharegpt: continuous / static batching >= 2.5", r.get("jaxserve/static"), 2.5)
        goal(
            "sharegpt: jaxserve / transformers generate >= 6",
            r.get("jaxserve/hf-transformers"),
            6.0,
        )
        js = e.get("jaxserve", {})
        goal("sharegpt: peak KV slot utilization >= 0.97", js.get("peak_kv_slot_utilization"), 0.97)
        goal(
            "sharegpt: model FLOP/s / matmul FLOP/s >= 0.5 (whole run)",
            js.get("mfu_vs_matmul"),
            0.5,
        )
    px = report["datasets"].get("prefix")
    if px:
        on_off = px.get("cache_on_off", {})
        goal("prefix: caching on / off >= 1.6", on_off.get("jaxserve"), 1.6)
        js = px["engines"].get("jaxserve", {})
        if "prefix_hit_rate" in js:
            gap = js["ideal_prefix_hit_rate"] - js["prefix_hit_rate"]
            goal(
                "prefix: hit rate within 0.02 of ideal (ideal - measured)", gap, 0.02, higher=False
            )
    compiles = sum(
        s.get("compilations_during_run", 0)
        for d in report["datasets"].values()
        for s in d["engines"].values()
    )
    goal("compilations after warm-up == 0", compiles, 0, higher=False)
    return out


def print_table(report: dict) -> None:
    print(
        f"\nmodel {report['model']['name']} ({report['model']['num_params'] / 1e6:.1f}M params, "
        f"fp32), load avg start {report['machine']['loadavg']['start']} end "
        f"{report['machine']['loadavg'].get('end')}"
    )
    lim = report["info"]["machine_limits"]
    print(
        f"machine: matmul {lim['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, "
        f"streaming copy {lim['copy_bytes_per_s'] / 1e9:.1f} GB/s (jnp "
        f"{lim['copy_jnp_bytes_per_s'] / 1e9:.1f}, numpy {lim['copy_numpy_bytes_per_s'] / 1e9:.1f})"
    )
    head = (
        f"{'dataset':9s} {'engine':17s} {'req/s':>6s} {'out tok/s':>9s} {'tot tok/s':>9s} "
        f"{'ttft p50':>8s} {'ttft p99':>8s} {'tpot p50':>8s} {'tpot p99':>8s} "
        f"{'x ours':>6s} {'kv peak':>7s} {'hit':>6s} {'ideal':>6s} {'MFU':>5s} {'comp':>4s}"
    )
    print(head)
    print("-" * len(head))
    for name, d in report["datasets"].items():
        for engine, s in d["engines"].items():
            ratio = d["ratios"].get(f"jaxserve/{engine}")
            print(
                f"{name:9s} {engine:17s} {s['requests_per_s']:6.2f} "
                f"{s['output_tokens_per_s']:9.1f} {s['total_tokens_per_s']:9.1f} "
                f"{_ms(s['ttft_ms_p50'])} {_ms(s['ttft_ms_p99'])} {_ms(s['tpot_ms_p50'])} "
                f"{_ms(s['tpot_ms_p99'])} {_fmt(ratio, 6, 2)} "
                f"{_fmt(s.get('peak_kv_slot_utilization'), 7, 3)} "
                f"{_fmt(s.get('prefix_hit_rate'), 6, 3)} "
                f"{_fmt(s.get('ideal_prefix_hit_rate'), 6, 3)} "
                f"{_fmt(s.get('mfu_vs_matmul'), 5, 2)} "
                f"{_fmt(s.get('compilations_during_run'), 4, 0)}"
            )
    for name, d in report["datasets"].items():
        on_off = d.get("cache_on_off")
        if on_off:
            parts = [f"{e} {v:.2f}x" for e, v in on_off.items() if e != "work_ratio"]
            if "work_ratio" in on_off:
                parts.append(f"work ratio (FLOPs off / on) {on_off['work_ratio']:.2f}x")
            print(f"{name}: prefix caching on / off: " + ", ".join(parts))
    js = report["info"].get("jaxserve", {})
    print(
        f"\njaxserve warm-up: {js.get('warmup_s', 0):.1f} s, "
        f"{js.get('warmup_compilations')} compilations (+{js.get('warmup_run_compilations')} "
        "in the warm-up run); 'comp' = compilations during the timed run"
    )
    for g in report["goals"]:
        mark = "OK  " if g["holds"] else "MISS"
        print(f"  [{mark}] {g['goal']}: measured {g['measured']:.3g}")


def _ms(v) -> str:
    return f"{v:8.1f}" if v is not None else f"{'-':>8s}"


def _fmt(v, width: int, digits: int) -> str:
    return f"{v:{width}.{digits}f}" if v is not None else f"{'-':>{width}s}"
