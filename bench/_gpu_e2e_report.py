"""bench/gpu_e2e.py's summary (the headline numbers) and the table it prints."""

from __future__ import annotations

from _gpu_e2e_presets import PUBLISHED_VLLM


def build_summary(report: dict) -> dict:
    """The headline numbers (None where a phase did not get that far)."""
    res = report["results"]
    cold, warm, hf = res.get("cold", {}), res.get("warm", {}), res.get("hf", {})
    run, hf_run = cold.get("run", {}), hf.get("run", {})
    js_tps, hf_tps = run.get("output_tokens_per_s"), hf_run.get("output_tokens_per_s")
    plan = (cold.get("stats") or {}).get("plan") or {}
    out = dict(
        cold_start_s=cold.get("start_s"),
        cold_ready_after_spawn_s=cold.get("ready_after_spawn_s"),
        cold_construct_s=cold.get("construct_s"),
        cold_warmup_s=cold.get("warmup_s"),
        cold_warmup_complete=cold.get("warmup_complete"),
        warmup_compilations=cold.get("warmup_compilations"),
        warm_start_s=warm.get("start_s"),
        warm_ready_after_spawn_s=warm.get("ready_after_spawn_s"),
        warm_construct_s=warm.get("construct_s"),
        warm_warmup_s=warm.get("warmup_s"),
        warm_cache_hits=warm.get("warmup_cache_hits"),
        warm_compilations=warm.get("warmup_compilations"),
        attention=plan.get("attention"),
        jaxserve_output_tokens_per_s=js_tps,
        jaxserve_num_requests=run.get("num_requests"),
        jaxserve_run_complete=run.get("complete"),
        jaxserve_compilations_during_run=run.get("compilations_during_run"),
        hf_output_tokens_per_s=hf_tps,
        hf_num_requests=hf_run.get("num_requests"),
        hf_run_complete=hf_run.get("complete"),
        jaxserve_over_hf=js_tps / hf_tps if js_tps and hf_tps else None,
        jaxserve_over_hf_basis=(
            "jaxserve on every request, transformers on its subset (output tokens/s each)"
        ),
        vllm_published_output_tokens_per_s=PUBLISHED_VLLM["output_tokens_per_s"],
        jaxserve_over_vllm_published=(
            js_tps / PUBLISHED_VLLM["output_tokens_per_s"] if js_tps else None
        ),
    )
    return out


def _fmt(value, spec: str = ".1f", unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:{spec}}{unit}"


def print_table(report: dict) -> None:
    s = report["summary"]
    rows = [
        (
            "checkpoint",
            _fmt(report["checkpoint"].get("write_s"), ".1f", " s write")
            + (" (reused)" if report["checkpoint"].get("reused") else ""),
        ),
        (
            "cold start (construct + warmup)",
            _fmt(s["cold_start_s"], ".1f", " s")
            + f"  ({_fmt(s['cold_construct_s'])} + {_fmt(s['cold_warmup_s'])} s, "
            f"{_fmt(s['warmup_compilations'], 'd')} compilations"
            + (", warm-up cut short)" if s["cold_warmup_complete"] is False else ")"),
        ),
        (
            "warm start (construct + warmup)",
            _fmt(s["warm_start_s"], ".1f", " s")
            + f"  ({_fmt(s['warm_construct_s'])} + {_fmt(s['warm_warmup_s'])} s, "
            f"{_fmt(s['warm_cache_hits'], 'd')} cache hits)",
        ),
        (
            "jaxserve output tok/s",
            _fmt(s["jaxserve_output_tokens_per_s"])
            + f"  ({_fmt(s['jaxserve_num_requests'], 'd')} requests, complete: "
            f"{_fmt(s['jaxserve_run_complete'])}, attention {s['attention'] or '-'})",
        ),
        (
            "transformers output tok/s",
            _fmt(s["hf_output_tokens_per_s"])
            + f"  ({_fmt(s['hf_num_requests'], 'd')} requests, complete: "
            f"{_fmt(s['hf_run_complete'])})",
        ),
        ("jaxserve / transformers", _fmt(s["jaxserve_over_hf"], ".2f", "x")),
        (
            "vLLM published (not measured)",
            _fmt(s["vllm_published_output_tokens_per_s"], ".0f")
            + f" tok/s; jaxserve / that {_fmt(s['jaxserve_over_vllm_published'], '.2f', 'x')}",
        ),
    ]
    print("\n" + "\n".join(f"  {name:34s} {value}" for name, value in rows), flush=True)
