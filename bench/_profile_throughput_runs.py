"""bench/profile_throughput.py's instrumented runs: an offline run with every step probed (a
window of it, optionally under cProfile), the sharegpt and decode parts built on it, and their
printed summaries.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path

import _datasets
import _jaxserve_runs
from _metrics import ModelShape, machine_limits
from _profile_throughput_probe import StepProbe, summarize_steps


def profile_run(
    engine,
    requests,
    *,
    name: str,
    shape: ModelShape,
    max_steps=None,
    skip_until_all_decode: bool = False,
    profile_host: bool = False,
    finished_only: bool = True,
    matmul_n: int = 2048,
) -> dict:
    """Offline run of `requests` with every step instrumented (optionally a window only)."""
    from jaxserve import SamplingParams

    _jaxserve_runs.reset_scheduler(engine, True)
    probe = StepProbe(engine, finished_only)
    for i, req in enumerate(requests):
        params = SamplingParams(max_tokens=req.output_len, temperature=1.0, ignore_eos=True, seed=i)
        engine.add_request(f"{name}-{i}", req.prompt_token_ids, params)
    compiles = _jaxserve_runs.compiles(engine)
    n = len(requests)
    if skip_until_all_decode:  # run the prefill phase uninstrumented-in-summary
        while True:
            probe.step()
            rec = probe.records[-1]
            if rec["rows"] == n and rec["decode_rows"] == n:
                break
        probe.records.clear()
    local_peak = machine_limits(matmul_n, copy_mib=1, reps=2)["matmul_flops_per_s"]
    prof = cProfile.Profile() if profile_host else None
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests() and (max_steps is None or steps < max_steps):
        if prof:
            prof.enable()
        probe.step()
        if prof:
            prof.disable()
        steps += 1
    elapsed = time.perf_counter() - t0
    if engine.has_unfinished_requests():
        engine.abort_request([f"{name}-{i}" for i in range(n)])
    probe.uninstall()
    out = summarize_steps(probe.records, shape)
    out["local_matmul_flops_per_s"] = local_peak
    out["mfu_vs_local_matmul"] = out["model_flops_per_s"] / local_peak
    during_run = _jaxserve_runs.compiles(engine) - compiles
    out.update(elapsed_s=elapsed, compilations_during_run=during_run)
    if prof:
        out["host_profile_top"] = _top_functions(prof, 18)
    return out


def _top_functions(prof: cProfile.Profile, n: int) -> list[dict]:
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, func), (_cc, calls, tottime, cumtime, _) in stats.stats.items():
        rows.append(
            {
                "function": f"{Path(file).name}:{line}:{func}",
                "calls": calls,
                "tottime_s": tottime,
                "cumtime_s": cumtime,
            }
        )
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[:n]


def print_summary(title: str, s: dict) -> None:
    print(
        f"\n{title}: {s['num_steps']} steps, {s['total_ms']:.1f} ms/step "
        f"(device {s['device_ms']:.1f}, host {s['host_ms']:.1f} = {s['host_share']:.1%}); "
        f"{s['model_flops_per_s'] / 1e9:.1f} useful GFLOP/s = {s['mfu_vs_local_matmul']:.0%} "
        "of a matmul timed just before"
    )
    print(
        f"  host per step: schedule {s['schedule_ms']:.2f} ms, prepare+collect "
        f"{s['prepare_and_collect_ms']:.2f} ms, update {s['update_ms']:.2f} ms, engine outputs "
        f"{s['engine_output_ms']:.2f} ms; the step call itself returned after "
        f"{s['dispatch_ms']:.2f} of the device ms (CPU: dispatch is not fully asynchronous)"
    )
    print(
        f"  tokens/step real {s['mean_real_tokens']:.0f} padded {s['mean_padded_tokens']:.0f} "
        f"(waste {s['token_padding_waste']:.1%}), rows {s['mean_rows']:.0f} (row waste "
        f"{s['row_padding_waste']:.1%}); attention reads {s['attention_reads_per_needed']:.1f}x "
        f"the context positions needed"
    )
    for k, v in list(s["bucket_histogram"].items())[:6]:
        print(
            f"    bucket {k:18s} {v['steps']:5d} steps, {v['device_ms']:7.1f} ms device, "
            f"{v['device_share']:5.1%} of device time, {v['mean_real_tokens']:6.1f} real tokens"
        )
    for r in s.get("host_profile_top", [])[:12]:
        print(
            f"    {r['tottime_s'] * 1e3 / s['num_steps']:7.2f} ms/step own  "
            f"{r['calls']:7d} calls  {r['function']}"
        )


def profile_sharegpt(engine, preset, settings, shape: ModelShape, args, matmul_n: int) -> dict:
    """The "sharegpt" part: the preset's ShareGPT-like offline run, profiled; prints it."""
    n = args.num_requests or preset.num_requests
    ds = _datasets.build(
        "sharegpt", n, shape.vocab, settings.block_size, **preset.dataset_kw.get("sharegpt", {})
    )
    s = profile_run(
        engine,
        ds.requests,
        name="profile-sharegpt",
        shape=shape,
        finished_only=not args.every_step_outputs,
        matmul_n=matmul_n,
    )
    print_summary(f"sharegpt ({n} requests, offline)", s)
    return s


def profile_decode(engine, settings, shape: ModelShape, args, matmul_n: int) -> dict:
    """The "decode" part: --concurrency requests decoding together, --decode-steps steps
    profiled; prints it. SystemExit when --concurrency exceeds max_num_seqs."""
    c = args.concurrency
    if c > settings.max_num_seqs:
        raise SystemExit(f"--concurrency {c} exceeds max_num_seqs={settings.max_num_seqs}")
    ds = _datasets.random_fixed(
        c,
        shape.vocab,
        input_len=min(128, settings.max_model_len // 4),
        output_len=min(args.decode_steps + 64, settings.max_model_len * 3 // 4 - 1),
        seed=1,
    )
    s = profile_run(
        engine,
        ds.requests,
        name="profile-decode",
        shape=shape,
        max_steps=args.decode_steps,
        skip_until_all_decode=True,
        profile_host=True,
        finished_only=not args.every_step_outputs,
        matmul_n=matmul_n,
    )
    print_summary(f"decode at {c} running requests", s)
    return s
