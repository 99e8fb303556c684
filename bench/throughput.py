"""Offline throughput, side by side, in the spirit of `vllm bench throughput`.

jaxserve (continuous batching, prefix caching on) against, on the same checkpoint and the same
token-id prompts, in one run:

    static     the same model and jitted step, fed the pre-vLLM way (bench/_jaxserve_runs.py)
    nocache    jaxserve with prefix caching off (datasets with shared prefixes only)
    hf         Hugging Face transformers `generate`, PyTorch CPU float32, batches of 16
    vllm       vLLM itself (its CPU build, run by bench/vllm_throughput.py in its own venv)
    vllm-nocache  vLLM with prefix caching off (datasets with shared prefixes only): its own
               on / off ratio beside jaxserve's

On the prefix dataset the report also gives the work ratio: the model FLOPs of the run with
caching off over those with it on (prefill skipped for cached tokens, decode unchanged), the
on / off speedup that cache would give if every token cost the same.

Datasets (bench/_datasets.py): sharegpt (lognormal lengths), random (fixed lengths with a range
ratio), prefix (shared 256-token prefixes). Requests run with ignore_eos and temperature 1.0 (as
`vllm bench throughput` does), so every engine generates exactly the same number of tokens.

Reported per engine: requests/s, output and total tokens/s, TTFT / TPOT / end-to-end
percentiles (from the step at which each token reached the caller), and for jaxserve the peak
KV slot utilization, prefix hit rate (vs the dataset's ideal), preemptions, compilations in
warm-up and during the timed runs, and model FLOP/s and bytes/s against the machine's matmul
and streaming copy measured in the same run. jaxserve's continuous run is done first and again
last ("bracketing"): ratios use the mean of the two, which cancels a linear drift of the
machine's load; the spread of the two is reported.

    python bench/throughput.py                      # full run: 50M-param model, all baselines
    python bench/throughput.py --preset quick       # tiny model, < 3 min (~1 min of it vLLM)
    python bench/throughput.py --baselines static,hf --datasets sharegpt --num-requests 32
    python bench/throughput.py --request-rate 4     # Poisson arrivals (jaxserve only)

Writes bench/results/throughput.json (quick: throughput_quick.json); plot with bench/plot.py.
The benchmark checkpoint is random-weight, Llama-shaped, written by transformers itself into
bench/.cache/ on first use.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _throughput_bench import Bench  # noqa: E402

# CACHE and ensure_checkpoint are imported from here by the other benchmarks.
from _throughput_presets import (  # noqa: E402, F401
    ALL_BASELINES,
    CACHE,
    PRESETS,
    ensure_checkpoint,
)
from _throughput_report import print_table  # noqa: E402

from jaxserve.runner.xla_flags import apply_cpu_workarounds  # noqa: E402

RESULTS = HERE / "results"
DEFAULT_VLLM_PYTHON = "/tmp/vllm-venv/bin/python"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--datasets", help="comma list of sharegpt,random,prefix (preset's default)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--baselines", help=f"comma list of {','.join(ALL_BASELINES)} or 'none'")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals (req/s) for jaxserve; inf = all at once",
    )
    p.add_argument("--static-batch-size", type=int, default=16)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-bracket",
        dest="bracket",
        action="store_false",
        help="do not rerun jaxserve at the end",
    )
    p.add_argument(
        "--cache",
        default=str(CACHE),
        help="where benchmark checkpoints (and the XLA compile cache) live",
    )
    p.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_false",
        help="do not use JAX's persistent compilation cache in <cache>/jax",
    )
    p.add_argument(
        "--async-scheduling",
        default="",
        help="comma list of on,off: jaxserve passes with async scheduling so, beside the "
        "plan's default (named jaxserve-async-on / -off)",
    )
    p.add_argument("--output", help="results JSON (default: bench/results/<preset file>)")
    args = p.parse_args(argv)
    modes = [m for m in args.async_scheduling.split(",") if m]
    if set(modes) - {"on", "off"}:
        p.error(f"--async-scheduling takes on and off, got {args.async_scheduling!r}")
    args.async_scheduling = [m == "on" for m in modes]
    preset = PRESETS[args.preset]
    args.datasets = args.datasets.split(",") if args.datasets else list(preset.datasets)
    if args.baselines is None:
        args.baselines = list(preset.baselines)
    else:
        args.baselines = [] if args.baselines == "none" else args.baselines.split(",")
    unknown = set(args.baselines) - set(ALL_BASELINES)
    if unknown:
        p.error(f"unknown baselines {sorted(unknown)}; choose from {ALL_BASELINES}")
    args.output = Path(args.output) if args.output else RESULTS / preset.output
    return args


def enable_compile_cache(folder: Path) -> None:
    """JAX's persistent compilation cache: a rerun's warm-up loads executables from disk
    instead of compiling them (tracing, and so the compilation counter, is unchanged)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv: list[str] | None = None) -> dict:
    apply_cpu_workarounds()  # before jax starts: it runs jax before building an engine
    args = parse_args(argv)
    if args.compile_cache:
        enable_compile_cache(Path(args.cache) / "jax")
    bench = Bench(args, PRESETS[args.preset])
    t0 = time.perf_counter()
    bench.run_all()
    bench.wall_s = time.perf_counter() - t0
    report = bench.save()
    print_table(report)
    print(f"\nwrote {args.output} ({report['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
