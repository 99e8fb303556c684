"""Batch jobs side by side: LLM.generate, `jaxserve run-batch`, `jaxserve generate --output`
and Ray Data, on the same prompts, in one run.

Every path gets the same requests: ShareGPT-like token-id prompts (bench/_datasets.py), each
with a fixed output length, greedy (temperature 0) with ignore_eos, so that every path does
exactly the same work and must produce the same token ids. Each path runs in its own fresh
Python process (sys.executable) with the same engine settings and one shared persistent
compilation cache (<cache>/jax, given as LLM(compilation_cache_dir=...) or
--compilation-cache-dir), so that compilations are loaded from disk rather than repeated:

    generate      LLM(...) built and warmed up, then one LLM.generate call over every request
                  (the reference): output tokens / seconds of that call.
    run-batch     `jaxserve run-batch -i batch.jsonl -o out.jsonl` (OpenAI batch format,
                  /v1/completions bodies: prompt = token ids, max_tokens, ignore_eos,
                  temperature 0), run in-process in the child through jaxserve.cli.main; the
                  time is the job's own (BatchSummary.elapsed_s, what the summary line
                  `output tokens: N in S s` prints): the engine build is not in it.
    generate-cli  `jaxserve generate --input prompts.jsonl --output out.jsonl` (resumable,
                  LLM.stream underneath), the same way; the time is its summary's `elapsed`
                  (model load excluded).
    generate-again  the reference once more, last of the jaxserve paths (default preset:
                  "bracketing"): ratios use the mean of the two reference runs, which cancels a
                  linear drift of the machine's load; their spread is reported.
    ray-1, ray-2  jaxserve.ray.build_processor(concurrency=1 / 2) over a ray.data.Dataset of
                  the same rows on a local 2-CPU Ray cluster (127.0.0.1 only, no dashboard):
                  wall time of the whole dataset execution, which INCLUDES each actor's start
                  and engine build (the actors build their engines concurrently).

The children record extra facts without changing what they run: the engine's compilations
(fresh + loaded from the cache) during the timed part, and, for run-batch, the generated
token ids (its output records carry text only; AsyncLLM.generate is wrapped in the child to
keep each request's final token ids).

Correctness: every path's token ids are compared with the reference's, request by request
(mismatches recorded; paths 1-3 must agree: a goal).

    python bench/batch.py                      # llama-57m, 128 requests, Ray 1 and 2 actors
    python bench/batch.py --preset tiny        # tiny-random-llama, 12 short requests, no Ray
    python bench/batch.py --preset tiny --ray --output /tmp/b.json

Writes bench/results/batch.json (--output overrides).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _batch_children import CHILDREN, child_main  # noqa: E402
from _batch_presets import PRESETS  # noqa: E402
from _batch_report import print_table  # noqa: E402
from _batch_run import Bench  # noqa: E402

CACHE = HERE / ".cache"
RESULTS = HERE / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    ray = p.add_mutually_exclusive_group()
    ray.add_argument("--ray", dest="ray", action="store_true", default=None, help="run Ray Data")
    ray.add_argument("--no-ray", dest="ray", action="store_false", help="skip Ray Data")
    p.add_argument("--ray-num-cpus", type=int, default=2, help="the local Ray cluster's CPUs")
    p.add_argument("--ray-batch-size", type=int, help="rows per engine call (default: n / actors)")
    br = p.add_mutually_exclusive_group()
    br.add_argument("--bracket", dest="bracket", action="store_true", default=None)
    br.add_argument(
        "--no-bracket", dest="bracket", action="store_false", help="no second reference run"
    )
    p.add_argument("--no-warmup", action="store_true", help="engines compile shapes on first use")
    p.add_argument(
        "--cache", default=str(CACHE), help="checkpoints and the compilation cache (<cache>/jax)"
    )
    p.add_argument("--child-timeout", type=float, help="seconds per path (default: the preset's)")
    p.add_argument("--keep-workdir", action="store_true", help="keep the inputs and outputs")
    p.add_argument("--output", help="results JSON (default bench/results/batch.json)")
    # internal: one path in a child process
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.ray is None:
        args.ray = preset.ray
    if args.bracket is None:
        args.bracket = preset.bracket
    args.output = Path(args.output) if args.output else RESULTS / "batch.json"
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bench = Bench(args)
    t0 = time.perf_counter()
    try:
        bench.run_all()
        report = bench.report(time.perf_counter() - t0)
    finally:
        if args.keep_workdir:
            print(f"inputs and outputs kept in {bench.work}")
        else:
            shutil.rmtree(bench.work, ignore_errors=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))
    print_table(report)
    print(f"\nwrote {args.output} ({report['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    if "--child" in sys.argv:
        a = parse_args()
        sys.exit(child_main(a.child, a.spec))
    main()
