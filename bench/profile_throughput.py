"""Where jaxserve's time goes on bench/throughput.py's model: host vs device per step, padding,
attention vs context bucket, sampling, compilations.

    python bench/profile_throughput.py [--preset default] [--concurrency 256]

Four parts, one warmed-up engine (the benchmark's preset and checkpoint):

    steps      the jitted step alone on synthetic batches of T tokens whose rows all have one
               context length, greedy and sampled (temperature 1.0): ms per call, dense
               FLOP/s against the matmul measured here, and how attention's cost grows with
               the context
    attention  one layer's attention op alone (x layers) at given contexts: the xla backend at
               several chunk sizes and the reference with its width bucket
    sharegpt   the benchmark's ShareGPT-like offline run, every step instrumented: scheduler,
               input preparation, the step call, waiting for the device, update_from_output,
               the engine's output processing; padding of T, R and of attention's width
    decode     `--concurrency` requests of 128 prompt tokens admitted together; once all of
               them decode, `--decode-steps` steps are timed the same way and profiled with
               cProfile (host functions by own time)

The engine steps as LLM.generate steps it (step(finished_only=True): no RequestOutput per
running request per step); `--every-step-outputs` times what a streaming caller pays instead.

Instrumentation wraps methods of this engine instance (nothing in jaxserve is edited): the
step wrapper waits for the step's sampled ids, so "device" is dispatch-to-ready time and every
other millisecond of an engine step is host time. On this CPU the host and XLA share the same
cores: host work can only hide behind device work to the extent cores are idle.

Writes bench/results/throughput_profile.json and prints tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _jaxserve_runs  # noqa: E402
import throughput  # noqa: E402
from _metrics import ModelShape, machine_limits  # noqa: E402
from _profile_throughput_micro import attention_microbench, step_microbench  # noqa: E402
from _profile_throughput_runs import profile_decode, profile_sharegpt  # noqa: E402

from jaxserve.runner.xla_flags import apply_cpu_workarounds  # noqa: E402


def profile_goals(report: dict, concurrency: int) -> list[dict]:
    """The issue's per-step goals that this profile measures."""
    goals = []
    dec = report.get("decode")
    if dec:
        goals.append(
            {
                "goal": f"host time per step <= 5% at {concurrency} running",
                "measured": dec["host_share"],
                "holds": dec["host_share"] <= 0.05,
            }
        )
        goals.append(
            {
                "goal": f"useful FLOP/s >= 50% of matmul at {concurrency} running",
                "measured": dec["mfu_vs_local_matmul"],
                "holds": dec["mfu_vs_local_matmul"] >= 0.5,
            }
        )
    runs = [report[k] for k in ("sharegpt", "decode") if k in report]
    if runs:
        n = sum(r["compilations_during_run"] for r in runs)
        goals.append({"goal": "compilations after warm-up == 0", "measured": n, "holds": n == 0})
    return goals


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(throughput.PRESETS), default="default")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--num-requests", type=int, default=None, help="sharegpt part")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--parts", default="steps,attention,sharegpt,decode")
    p.add_argument(
        "--every-step-outputs",
        action="store_true",
        help="engine.step() returns every running request's output each step (a streaming "
        "caller's host cost); default: finished ones only, as LLM.generate runs",
    )
    p.add_argument("--cache", default=str(throughput.CACHE))
    p.add_argument("--output", default=str(throughput.RESULTS / "throughput_profile.json"))
    return p.parse_args(argv)


def _step_shapes(buckets, max_ctx: int, concurrency: int) -> list[tuple[int, int]]:
    """(T, context) of the "steps" part's synthetic batches, each once, in order."""
    t_max = buckets.token_buckets[-1]
    decode_t = buckets.padded_tokens(min(concurrency, t_max))
    contexts = sorted({c for c in (1, 128, 256, 512, 1024, max_ctx) if c <= max_ctx})
    shapes = [(decode_t, c) for c in contexts]  # decode at high concurrency
    shapes += [(t_max, c) for c in contexts[:2]]  # a full prefill budget
    # A small batch (the tail of an offline run): few tokens, short and long contexts.
    small = sorted({buckets.padded_tokens(min(t, t_max)) for t in (4, 8, 16)})
    shapes += [(t, c) for t in small for c in (contexts[1], max_ctx)]
    return list(dict.fromkeys(shapes))  # each once, in order


def _attention_cases(buckets, max_model_len: int, concurrency: int) -> list[tuple[int, int]]:
    """(T, context) of the "attention" part's cases."""
    t_max = buckets.token_buckets[-1]
    decode_t = buckets.padded_tokens(min(concurrency, t_max))
    contexts = [c for c in (32, 128, 512, 2048) if c <= max_model_len]
    cases = [(decode_t, c) for c in contexts]
    # The tail of an offline run: few tokens, long contexts.
    small = sorted({buckets.padded_tokens(min(t, t_max)) for t in (4, 16)})
    cases += [(t, c) for t in small for c in contexts[-2:]]
    cases += [(t_max, c) for c in contexts[1:3]]
    return cases


def main(argv: list[str] | None = None) -> dict:
    apply_cpu_workarounds()  # before jax starts: it runs jax before building an engine
    args = _parse_args(argv)
    parts = args.parts.split(",")
    preset = throughput.PRESETS[args.preset]
    throughput.enable_compile_cache(Path(args.cache) / "jax")
    model_dir = throughput.ensure_checkpoint(preset, Path(args.cache))
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    settings = _jaxserve_runs.EngineSettings(model=str(model_dir), **preset.engine)
    report: dict = {
        "preset": args.preset,
        "step_outputs": "every step" if args.every_step_outputs else "finished only",
        "loadavg_start": os.getloadavg(),
        "model": {"name": preset.model_name, "num_params": shape.num_params},
    }
    report["machine_limits"] = limits = machine_limits(**preset.limits)
    print(
        f"matmul {limits['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, copy "
        f"{limits['copy_bytes_per_s'] / 1e9:.1f} GB/s; load {os.getloadavg()}",
        flush=True,
    )
    engine, warm_s, warm_compiles = _jaxserve_runs.build_engine(settings)
    report["warmup"] = {"seconds": warm_s, "compilations": warm_compiles}
    buckets = engine.runner.buckets
    if "steps" in parts:
        print("\nstep alone (synthetic batches, every row at the given context):", flush=True)
        shapes = _step_shapes(buckets, settings.max_model_len, args.concurrency)
        report["steps"] = step_microbench(engine, shape, limits, shapes, args.reps)
    if "attention" in parts:
        print("\nattention alone (one layer's op x layers):", flush=True)
        cases = _attention_cases(buckets, settings.max_model_len, args.concurrency)
        report["attention"] = attention_microbench(engine, shape, cases, args.reps)
    if "sharegpt" in parts:
        report["sharegpt"] = profile_sharegpt(
            engine, preset, settings, shape, args, limits["matmul_n"]
        )
    if "decode" in parts:
        report["decode"] = profile_decode(engine, settings, shape, args, limits["matmul_n"])
    report["loadavg_end"] = os.getloadavg()
    report["goals"] = profile_goals(report, args.concurrency)
    for g in report["goals"]:
        print(f"  [{'OK  ' if g['holds'] else 'MISS'}] {g['goal']}: measured {g['measured']:.3g}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
