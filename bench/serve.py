"""Online serving benchmark, in the spirit of `vllm bench serve`: jaxserve's OpenAI server and
vLLM's, one after the other in the same run, under Poisson arrivals over HTTP.

Workload: bench/throughput.py's ShareGPT-like set (bench/_datasets.py: lognormal lengths,
token-id prompts), each request a streaming /v1/completions call with ``ignore_eos: true`` and
``max_tokens`` = its output length, so both servers generate exactly the same tokens. Each
server is started as a subprocess on 127.0.0.1 (a free port), waited for on ``GET /health``,
warmed up with a few short requests, then driven at every request rate in turn:

    saturation   all requests sent at once (rate = inf), run first: its request throughput
                 sets the rates (default preset: fractions of jaxserve's, see --rate-fractions)
    rate r       request i sent at its arrival time of a seeded Poisson process of rate r
                 (bench/_jaxserve_runs.poisson_arrivals); the same arrivals for both servers
    search       then, per server, a bisection for the highest rate it sustains with p99 TTFT
                 <= 2 s (--search-steps runs between the grid's last passing and first failing
                 rate; sustained_rate below)

Every run sends prompts of its own: the same lengths (the same work) with other token ids
(_datasets.sharegpt_like's token_seed, from the run's key), identical for both servers at a
rate, so that no run reads a prefix cache that an earlier run filled (the workload has no
shared prefixes). The client (this process, aiohttp, as vLLM's `bench serve`: a third of
httpx's CPU per streamed chunk, which matters on a machine the servers share) runs one asyncio
task per request; every request and every run is bounded by a timeout. Measured per request,
from the moment its POST is sent:

    TTFT   until the first streamed chunk carrying a choice (its text may be empty)
    ITL    the gaps between consecutive choice chunks, each divided by the tokens per gap of
           that request ((completion_tokens - 1) / (chunks - 1)): equal to the plain gap when
           every chunk carries one token, which the reported tokens_per_chunk shows
    TPOT   (last chunk - first chunk) / (completion_tokens - 1)
    E2E    until the stream's end ([DONE])

Token counts come from the final ``usage`` chunk (``stream_options: {"include_usage": true}``),
never from the text. Per server and rate: p50 / p90 / p99 of each, request and output-token
throughput (over the time from the first send to the last finish). jaxserve's offline
``LLM.generate`` (same settings, in a subprocess, warmed up) runs the same requests, so that
served-at-saturation / offline throughput shows what serving costs: --overhead-repeats pairs of
an offline run and a saturation run, back to back, and the median of their ratios (the machine's
speed drifts between runs minutes apart by more than serving costs).

    python bench/serve.py                        # llama-57m, jaxserve + vLLM, ~30 min
    python bench/serve.py --preset queueing      # the same with max_num_seqs 32: a queue forms
    python bench/serve.py --preset tiny --vllm-python ''    # built-in tiny model, < 2 min
    python bench/serve.py --rates 0.5,1,2 --num-requests 64 --plot
    python bench/serve.py --preset tiny --data-parallel-size 2   # prefix vs round-robin routing
    python bench/serve.py --preset tiny --disagg                 # colocated vs disaggregated
    python bench/serve.py --preset tiny --disagg --kv-connectors shared_storage,jax_transfer
    python bench/serve.py --servers jaxserve,jaxserve-sync  # async scheduling on and off

Writes bench/results/serve.json (--output), and with --plot a PNG beside it (p99 TTFT and
output throughput against the rate). vLLM runs from its own interpreter (--vllm-python, a venv
with vLLM's CPU build; '' skips it, noted in the JSON). The benchmark model has no tokenizer:
both servers get the same word-level one (one word per id, written into bench/.cache), so that
every generated token streams as non-empty text and no server holds text back.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _serve_fleet  # noqa: E402
from _machine import git_state, loadavg, machine  # noqa: E402
from _serve_bench import ServeBench  # noqa: E402
from _serve_offline import offline_worker  # noqa: E402
from _serve_presets import CACHE, DEFAULT_VLLM_PYTHON, PRESETS, RESULTS, SERVERS  # noqa: E402
from _serve_report import (  # noqa: E402, F401  (the tests and other scripts read them here)
    SEARCH_REL_TOL,
    _json_safe,
    compare,
    goals,
    next_search_rate,
    plot,
    print_table,
    slo_bracket,
    sustained_rate,
)

# ---- command line -------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    """The command line's arguments; a None default is the preset's (parse_args fills it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--servers", help=f"comma list of {','.join(SERVERS)} (preset's default)")
    p.add_argument(
        "--vllm-python",
        default=DEFAULT_VLLM_PYTHON,
        help="interpreter with vLLM installed ('' skips vLLM)",
    )
    p.add_argument("--num-requests", type=int, help="requests a rate (preset's default)")
    p.add_argument(
        "--rates",
        type=_floats,
        help="comma list of request rates (req/s) after the saturation run (default: the "
        "preset's, else --rate-fractions of the first server's saturation req/s)",
    )
    p.add_argument("--rate-fractions", type=_floats, default=None)
    p.add_argument("--no-offline", dest="offline", action="store_false")
    p.add_argument(
        "--overhead-repeats",
        type=int,
        help="offline + saturation run pairs for the served / offline goal (preset's default)",
    )
    p.add_argument(
        "--search-steps",
        type=int,
        help="bisection runs per server for its sustained rate (preset's default; 0: none)",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds, per request")
    p.add_argument("--run-timeout", type=float, default=1200.0, help="seconds, per rate's run")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds, per server")
    p.add_argument("--cache", default=str(CACHE), help="checkpoints, tokenizer, compile cache")
    p.add_argument("--log-dir", help="server logs (default <cache>/serve-logs)")
    p.add_argument("--output", help="results JSON (default bench/results/<preset file>)")
    _add_fleet_flags(p)
    p.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        help="write a PNG (default: the JSON's path with .png)",
    )
    return p


def _add_fleet_flags(p: argparse.ArgumentParser) -> None:
    """--data-parallel-size and --disagg: the comparisons of bench/_serve_fleet.py instead."""
    p.add_argument(
        "--data-parallel-size",
        type=int,
        help="instead: a multi-turn chat workload on one engine and on N replicas routed by "
        "prefix and by round-robin (prefix hit rate, throughput, TTFT; bench/_serve_fleet.py)",
    )
    p.add_argument(
        "--disagg",
        action="store_true",
        help="instead: decodes under a burst of long prompts, colocated against a producer and "
        "a consumer behind jaxserve router (ITL, TTFT; bench/_serve_fleet.py)",
    )
    p.add_argument("--conversations", type=int, default=8, help="--data-parallel-size's")
    p.add_argument(
        "--think-time",
        type=float,
        default=0.2,
        help="--data-parallel-size's: mean seconds a user pauses before each turn (exponential, "
        "seeded; 0: every conversation in lockstep, which makes round-robin sticky)",
    )
    p.add_argument("--num-decodes", type=int, default=4, help="--disagg's streaming decodes")
    p.add_argument("--burst", type=int, default=4, help="--disagg's long prompts")
    p.add_argument(
        "--kv-connectors",
        default="shared_storage",
        help="--disagg's connectors, comma-separated, each a disaggregated run: shared_storage, "
        "jax_transfer",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    args.servers = args.servers.split(",") if args.servers else list(preset.servers)
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        p.error(f"unknown servers {sorted(unknown)}; choose from {SERVERS}")
    if len(set(args.servers)) < len(args.servers):
        p.error(f"--servers names a server twice: {args.servers}")
    if args.rates is None and preset.rates is not None:
        args.rates = list(preset.rates)
    if args.rate_fractions is None:
        args.rate_fractions = list(preset.rate_fractions)
    if args.overhead_repeats is None:
        args.overhead_repeats = preset.overhead_repeats
    if args.search_steps is None:
        args.search_steps = preset.search_steps
    args.kv_connectors = args.kv_connectors.split(",")
    bad = sorted(set(args.kv_connectors) - set(_serve_fleet.DISAGG_RUNS))
    if bad or len(set(args.kv_connectors)) < len(args.kv_connectors):
        known = list(_serve_fleet.DISAGG_RUNS)
        p.error(f"--kv-connectors {args.kv_connectors}: each at most once, from {known}")
    args.output_given = args.output is not None
    args.output = Path(args.output) if args.output else RESULTS / preset.output
    if args.plot is not None:
        args.plot = Path(args.plot) if args.plot else args.output.with_suffix(".png")
    args.log_dir = args.log_dir or str(Path(args.cache) / "serve-logs")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.data_parallel_size or args.disagg:
        return fleet_main(args)
    bench = ServeBench(args, PRESETS[args.preset])
    t0 = time.perf_counter()
    try:
        bench.run_all()
    finally:
        bench.wall_s = time.perf_counter() - t0
        report = bench.save()
    print_table(report)
    if args.plot is not None:
        try:
            print(f"plot: {plot(report, args.plot)}")
        except ImportError:
            print("plot: matplotlib is not installed (pip install matplotlib); no plot")
    print(f"wrote {args.output} ({report['wall_s']:.0f} s)")
    return report


def fleet_main(args: argparse.Namespace) -> dict:
    """--data-parallel-size / --disagg: the comparisons of bench/_serve_fleet.py."""
    preset = PRESETS[args.preset]
    if args.data_parallel_size is not None and args.data_parallel_size < 2:
        raise SystemExit("--data-parallel-size must be >= 2")
    t0 = time.perf_counter()
    if args.data_parallel_size:
        report = _serve_fleet.run_data_parallel(args, preset)
        default = f"serve_dp{args.data_parallel_size}_{args.preset}.json"
    else:
        report = _serve_fleet.run_disagg(args, preset)
        default = f"serve_disagg_{args.preset}.json"
    report.update(preset=args.preset, machine=machine({"start": loadavg()}), git=git_state(),
                  wall_s=time.perf_counter() - t0)  # fmt: skip
    output = args.output if args.output_given else RESULTS / default
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(_json_safe(report), indent=2))
    _serve_fleet.print_fleet(report)
    print(f"wrote {output} ({report['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--offline-worker":
        offline_worker(sys.argv[2])
    else:
        main()
