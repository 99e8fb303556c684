"""Start-up: warm-up, the compilation cache and serialized executables, compilations after
warm-up, and LLM(...) to the first token phase by phase.

Five experiments, side by side in one run. Every measurement is a fresh Python process
(sys.executable), timed from just before the spawn; each experiment gets its own fresh, empty
compilation-cache folder, passed as $JAXSERVE_COMPILATION_CACHE_DIR (jax's own
JAX_*COMPILATION_CACHE* / JAX_PERSISTENT_CACHE_* variables are removed from the child's
environment, and the child checks that jax's cache folder is unset before jaxserve sets it).
Ratios, not absolute times, are the result: the machine is shared and noisy.

    1 demo       README's first command, `jaxserve generate --input examples/prompts.jsonl
                 --output OUT` (the built-in tiny-random-llama, default engine settings: the
                 job's warm-up), run twice in two processes on the same cache folder: wall
                 time, fresh compilations and cache hits of each. Goals: first <= 30 s, second
                 <= 8 s and <= 1/3 of the first; 0 fresh in the second.
    2 construct  LLM(<model>, warmup=True, the throughput benchmark's engine settings), first
                 process (empty cache) then second (same cache): construction time, and the
                 warm-up part of it. Goal: second <= 25% of the first.
    3 workers    the first warm-up (empty cache), LLM(warmup=False) then
                 runner.warmup(workers=1) vs runner.warmup(workers=N), each in its own
                 process. Goal (accelerators): N workers halve it. On a CPU, XLA's compiler
                 already spreads one compilation over the cores: expect ~1x there.
    4 features   one process: LLM(tiny-random-llama, small config, warm-up on), then for each
                 SamplingParams feature a few prompts: fresh compilations and cache hits after
                 warm-up (get_stats before / after). Goal: all zero.
    5 phases     LLM(...) to the first token for the demo and the 57M model, first and second
                 process, and a notebook's rebuild in the same process (_startup_phases.py).
                 With --vllm-python, vLLM's CPU backend on the same 57M checkpoint in the
                 same run, its processes alternating with jaxserve's (_startup_vllm.py);
                 without, the issue's figure, labelled as not this run's. Goal: 57M second
                 process, LLM(...) to first token <= 0.35x vLLM-CPU's.
    6 server     a server (AsyncLLM) from spawn to a short request's first token, then a long
                 request, with enable_background_warmup off and on, cold and restarted
                 (_startup_server.py). Goal: restarted, on <= 0.5x off; the same tokens.
    7 demo57m    experiment 1 on the 57M model with the throughput benchmark's engine flags
                 (`jaxserve generate --model <57m> ...`: the job's warm-up, handed to the
                 construction, compiles while the weights load). Not in the default run.

Compilations are counted two ways: the engine's (get_stats: the step and the block copy, fresh
or loaded from the cache) and process-wide (jax's monitoring events: every XLA compilation in
the process, jaxserve's small helpers and jax's own included), with the names of the fresh
ones, so that a fresh compilation in a second process can be traced.

    python bench/startup.py                  # llama-57m (bench/throughput.py's checkpoint)
    python bench/startup.py --preset tiny    # tiny-random-llama, small engine: < 1 min
    python bench/startup.py --workers 4 --repeats 2 --output /tmp/startup.json
    python bench/startup.py --experiments phases --vllm-python /path/to/vllm-venv/bin/python

Writes bench/results/startup.json (--output overrides).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _startup_vllm as vllm_side  # noqa: E402
import throughput  # noqa: E402
from _machine import git_state  # noqa: E402
from _startup_goals import goals  # noqa: E402
from _startup_phases import phases  # noqa: E402
from _startup_presets import FEATURE_PROMPTS, FEATURES, MIXED, PRESETS, Preset  # noqa: E402
from _startup_procs import (  # noqa: E402
    cache_files,
    child_env,
    fresh_names,
    run_child,
    summary_counts,
    summary_line,
)
from _startup_report import print_report  # noqa: E402
from _startup_server import server_start  # noqa: E402

RESULTS = HERE / "results" / "startup.json"
EXPERIMENTS = ("demo", "construct", "workers", "features", "phases", "server", "demo57m")
DEMO_INPUT = HERE.parent / "examples" / "prompts.jsonl"  # README's first command reads it


# ---- the experiments -------------------------------------------------------------------------


def _compact(run: dict, keys: tuple[str, ...]) -> dict:
    out = {k: run[k] for k in keys if k in run}
    proc = run["process"]
    out["process"] = {**proc, "fresh_names": fresh_names(proc)}
    return out


def demo(preset: Preset, flags: tuple[str, ...] | None = None, token_ids: bool = False) -> dict:
    """Experiment 1: `jaxserve generate` twice on one cache folder (``flags``: the engine
    flags, default the preset's demo flags; ``token_ids``: the demo's prompts as token ids, for
    a model without a tokenizer: token_id_input)."""
    flags = preset.demo_flags if flags is None else flags
    runs = []
    with tempfile.TemporaryDirectory(prefix="startup-demo-") as cache:
        source = token_id_input(Path(cache) / "prompts.jsonl") if token_ids else DEMO_INPUT
        for i in range(2):
            print(f"  demo process {i + 1}/2 ...", flush=True)
            output = str(Path(cache) / f"out{i}.jsonl")  # a fresh results file each time
            argv = ["generate", "--input", str(source), "--output", output]
            argv += ["--no-progress", *flags]
            run = run_child({"mode": "demo", "argv": argv}, cache)
            if run["rc"] != 0:
                raise RuntimeError(f"jaxserve generate exited {run['rc']}: {run['stdout'][-5:]}")
            line = summary_line(run["stdout"])
            if summary_counts(line) != (run["engine"]["fresh"], run["engine"]["cache_hits"]):
                raise RuntimeError(f"the CLI summary {line!r} disagrees with {run['engine']}")
            compact = _compact(run, ("wall_s", "import_s", "engine", "warmup", "weights_s"))
            compact["summary_line"] = line
            compact["cache_after"] = cache_files(cache)
            runs.append(compact)
    first, second = runs
    return {
        "command": [
            "jaxserve",
            "generate",
            "--input",
            "examples/prompts.jsonl",
            "--output",
            "out.jsonl",
            *flags,
        ],  # fmt: skip
        "runs": runs,
        "wall_ratio": second["wall_s"] / first["wall_s"],
    }


def token_id_input(path: Path) -> Path:
    """The demo's prompts written to ``path`` as the demo tokenizer's token ids (the 57M
    checkpoint has no tokenizer), their sampling fields kept but stop strings (they need one)."""
    from jaxserve.checkpoints_tools.tiny_random import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    lines = []
    for text in DEMO_INPUT.read_text().splitlines():
        request = {k: v for k, v in json.loads(text).items() if k != "stop"}
        if "prompt" in request:
            request["prompt_token_ids"] = tokenizer.encode(request.pop("prompt")).ids
        lines.append(json.dumps(request))
    path.write_text("\n".join(lines) + "\n")
    return path


def model_flags(engine: dict) -> tuple[str, ...]:
    """`jaxserve generate` flags for an engine of LLM arguments (experiment 1 on the 57M model:
    the throughput benchmark's engine)."""
    flags = []
    for key, value in engine.items():
        if key == "enable_prefix_caching":
            flags += [] if value else ["--no-prefix-caching"]
            continue
        flags += [f"--{key.replace('_', '-')}", str(value)]  # seed: --seed, the engine's
    return tuple(flags)


def construct(preset: Preset, model: str, repeats: int = 2) -> dict:
    """Experiment 2: LLM(model, warmup=True) twice on one cache folder; then, on that folder
    (a restarted server), ``repeats`` pairs of second processes alternated: the weights loaded
    while the executables load (runner/startup.py) against loaded first, then compiled."""
    engine = {**preset.engine, "model": model}
    keys = ("wall_s", "import_s", "construct_s", "weights_s", "engine", "warmup")
    runs, restart = [], {"overlapped": [], "weights_first": []}
    with tempfile.TemporaryDirectory(prefix="startup-construct-") as cache:
        for i in range(2):
            print(f"  construct process {i + 1}/2 ...", flush=True)
            run = run_child({"mode": "construct", "engine": engine}, cache)
            compact = _compact(run, keys)
            compact["cache_after"] = cache_files(cache)
            runs.append(compact)
        order = []
        for r in range(repeats):  # a linear drift hits both alike
            pair = ["weights_first", "overlapped"]
            order += pair if r % 2 == 0 else pair[::-1]
        for i, mode in enumerate(order):
            print(f"  construct, second process, {mode} ({i + 1}/{len(order)}) ...", flush=True)
            spec = {"mode": "construct", "engine": engine, "weights_first": mode != "overlapped"}
            restart[mode].append(_compact(run_child(spec, cache), keys))
    first, second = runs
    mean = {m: sum(r["construct_s"] for r in rs) / len(rs) for m, rs in restart.items() if rs}
    return {
        "engine": engine,
        "runs": runs,
        "construct_ratio": second["construct_s"] / first["construct_s"],
        "warmup_ratio": second["warmup"]["warmup_s"] / first["warmup"]["warmup_s"],
        "wall_ratio": second["wall_s"] / first["wall_s"],
        "restart": {"order": order, "runs": restart, "construct_s_mean": mean},
        "overlap_ratio": mean["overlapped"] / mean["weights_first"] if len(mean) == 2 else None,
    }


def workers(preset: Preset, model: str, num_workers: int, repeats: int) -> dict:
    """Experiment 3: the first warm-up with 1 worker vs N, each in its own process and cache."""
    engine = {**preset.engine, "model": model}
    order = []
    for r in range(repeats):  # 1, N, N, 1, ...: a linear drift hits both alike
        order += [1, num_workers] if r % 2 == 0 else [num_workers, 1]
    runs: dict[int, list[dict]] = {1: [], num_workers: []}
    for i, w in enumerate(order):
        print(f"  warm-up workers={w} ({i + 1}/{len(order)}) ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="startup-workers-") as cache:
            run = run_child({"mode": "workers", "engine": engine, "workers": w}, cache)
        compact = _compact(run, ("wall_s", "construct_s", "warmup_s", "engine"))
        proc = run["warmup_process"]
        compact["warmup_process"] = {**proc, "fresh_names": fresh_names(proc)}
        runs[w].append(compact)
    mean = {w: sum(r["warmup_s"] for r in rs) / len(rs) for w, rs in runs.items()}
    return {
        "engine": engine,
        "workers": num_workers,
        "cpu_count": os.cpu_count(),
        "order": order,
        "runs": {str(w): rs for w, rs in runs.items()},
        "warmup_s_mean": {str(w): m for w, m in mean.items()},
        "speedup": mean[1] / mean[num_workers],
    }


def features(preset: Preset) -> dict:
    """Experiment 4: compilations after warm-up for every SamplingParams feature."""
    mixed = list(FEATURES.values())
    prompts = list(FEATURE_PROMPTS)
    prompts_mixed = [prompts[i % len(prompts)] + f" {i}" for i in range(len(mixed))]
    with tempfile.TemporaryDirectory(prefix="startup-features-") as cache:
        print("  features process ...", flush=True)
        run = run_child(
            {
                "mode": "features",
                "engine": preset.feature_engine,
                "runs": [[name, prompts, params] for name, params in FEATURES.items()]
                + [[MIXED, prompts_mixed, mixed]],
            },
            cache,
        )
    rows = run["features"]
    for row in rows.values():
        row["process"]["fresh_names"] = fresh_names(row["process"])
    return {
        "engine": preset.feature_engine,
        "prompts": prompts,
        "sampling": FEATURES,
        "warmup": run["warmup"],
        "features": rows,
        "total_after_warmup": sum(r["fresh"] + r["cache_hits"] for r in rows.values()),
    }


# ---- report --------------------------------------------------------------------------------


def _phase_models(preset: Preset, model: str) -> dict[str, dict]:
    """Experiment 5's engines: the demo's defaults and the 57M model's (the tiny preset: its
    small engine on the demo model only)."""
    if preset.engine["model"] is not None:
        return {"demo": preset.engine}
    return {"demo": {"model": "tiny-random-llama"}, "57m": {**preset.engine, "model": model}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--workers", type=int, default=4, help="experiment 3's concurrent compilations")
    p.add_argument("--repeats", type=int, help="experiment 3's runs per worker count (preset's)")
    p.add_argument(
        "--cache",
        default=str(throughput.CACHE),
        help="where the benchmark checkpoint lives (bench/throughput.py's, written on first use)",
    )
    p.add_argument(
        "--experiments",
        default=",".join(EXPERIMENTS[:-1]),
        help=f"comma-separated subset of {','.join(EXPERIMENTS)} (default: all but demo57m)",
    )
    p.add_argument(
        "--restart-repeats", type=int, default=2,
        help="experiment 2's pairs of second processes (weights first vs overlapped)",
    )  # fmt: skip
    p.add_argument(
        "--server-models", default="demo",
        help="experiment 6's models, comma-separated: demo, 57m (default: demo)",
    )  # fmt: skip
    p.add_argument(
        "--vllm-python", default=None, metavar="PATH",
        help="experiment 5: an interpreter with vLLM's CPU build, run on the 57M checkpoint in "
        "this run (default: none; the issue's figure, labelled as not this run's)",
    )  # fmt: skip
    p.add_argument(
        "--vllm-env", action="append", metavar="KEY=VALUE",
        help="experiment 5: an environment variable for vLLM's processes (repeatable; "
        "recorded), e.g. VLLM_USE_AOT_COMPILE=0",
    )  # fmt: skip
    p.add_argument(
        "--phases-repeats", type=int, default=1,
        help="experiment 5's second processes per engine (alternated with vLLM's; mean)",
    )  # fmt: skip
    p.add_argument("--output", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    vllm = None  # checked before anything runs: a bad --vllm-env, an interpreter without vLLM
    if args.vllm_python or args.vllm_env:
        vllm = vllm_side.start(args.vllm_python, vllm_side.parse_env(args.vllm_env))
    preset = PRESETS[args.preset]
    model = preset.engine["model"]
    if model is None:
        model = str(throughput.ensure_checkpoint(throughput.PRESETS["default"], Path(args.cache)))
    import jax

    report: dict = {
        "benchmark": "startup",
        "preset": args.preset,
        "description": preset.description,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jax_backend": jax.default_backend(),
            "loadavg": {"start": [round(x, 2) for x in os.getloadavg()]},
        },
        "git": git_state(),
    }
    t0 = time.perf_counter()
    chosen = args.experiments.split(",")
    unknown = sorted(set(chosen) - set(EXPERIMENTS))
    if unknown:
        raise SystemExit(f"--experiments: unknown {unknown}; known: {list(EXPERIMENTS)}")
    runs = {
        "demo": lambda: demo(preset),
        "demo57m": lambda: {
            **demo(preset, model_flags({**preset.engine, "model": model}), token_ids=True),
            "number": 7,
        },
        "construct": lambda: construct(preset, model, args.restart_repeats),
        "workers": lambda: workers(preset, model, args.workers, args.repeats or preset.repeats),
        "features": lambda: features(preset),
        "phases": lambda: phases(
            _phase_models(preset, model), child_env, vllm, args.phases_repeats
        ),
        "server": lambda: {
            name: server_start(engine, run_child, args.restart_repeats)
            for name, engine in _phase_models(preset, model).items()
            if name in args.server_models.split(",")
        },
    }
    for i, name in enumerate(EXPERIMENTS):
        if name in chosen:
            print(f"{i + 1} {name}", flush=True)
            report[name] = runs[name]()
    report["wall_s"] = time.perf_counter() - t0
    report["machine"]["loadavg"]["end"] = [round(x, 2) for x in os.getloadavg()]
    report["goals"] = goals(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print_report(report)
    print(f"\nwrote {args.output} ({report['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
