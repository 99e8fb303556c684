"""End to end on one GPU: jaxserve on a Llama-3-8B-shaped checkpoint against transformers.

    python bench/gpu_e2e.py --out e2e.json                      # llama3-8b preset, on the GPU
    python bench/gpu_e2e.py --preset tiny --out /tmp/e2e.json   # seconds, on CPU (tests)
    python bench/gpu_e2e.py --checkpoint-only                   # only write the checkpoint

Phases, each measured and written into the JSON (--out, rewritten after every phase, so a run
cut short keeps what it measured):

    checkpoint  a random-weight bf16 checkpoint in Hugging Face layout (config.json, sharded
                safetensors + index), Llama-3-8B's shape: hidden 4096, 32 layers, 32 heads,
                8 KV heads, intermediate 14336, vocab 128256, max_position_embeddings 8192
                (--layers for fewer layers). Written directly with numpy (no torch model:
                instantiating 8B parameters in torch would take minutes), once, into --cache;
                reused when present. Weights are normal(0, 0.02) drawn from one pool of random
                bf16 values (each tensor starts at its own offset), norms 1. No tokenizer: the
                prompts are token ids.
    cold        a fresh process: LLM(model=..., dtype="bfloat16") built without warm-up, then
                every step bucket compiled (the runner's warmup, one bucket at a time, each
                timed): cold_start_s = construct (load, plan, KV cache) + warmup, with jax's
                persistent compilation cache pointed at an empty folder (--compile-cache, set
                by this script: jax_compilation_cache_dir). Then, in the same process, the
                offline throughput run: --num-requests ShareGPT-like requests (bench/_datasets:
                sharegpt_like), all submitted at once, ignore_eos and temperature 1.0 so that
                every engine generates exactly the same lengths; output tokens/s, and the
                engine's get_stats() (the execution plan included). Should compiling run so
                long that less than Preset.run_reserve_s is left, the warm-up stops there (the
                JSON says so) and the run compiles the rest; a run still going at the deadline
                is cut, and the tokens generated so far count (complete: false).
    hf          transformers `generate` on the same GPU (torch, bf16, SDPA attention), static
                batches of --hf-batch-size in request order, left-padded, each batch
                generating its longest output (min_new_tokens = max_new_tokens, sampled at
                temperature 1.0); only each request's own output length counts as useful
                tokens. Static batching needs the batch's longest output per batch, so
                transformers runs a fixed subset, the first --hf-num-requests requests, and
                reports tokens/s on that subset; `generate(max_time=...)` stops it at the
                phase's deadline, and then the tokens done so far count (the JSON says so).
    warm        a third fresh process, the same construction and warm-up, now served by the
                persistent compilation cache the cold process filled: warm_start_s; then a
                short generate as a check that the loaded executables run. Last, so that it
                gets whatever time the others left.

Summary: cold and warm start, jaxserve's output tokens/s, transformers' output tokens/s on its
subset, their ratio, and vLLM's published 6,583 output tok/s for Llama-3.1-8B on one GPU (a
constant for context, labelled published: not measured here, other hardware and workload).

Time: every phase after the checkpoint runs in its own process with a deadline inside
--budget-s; the later phases' minimum is kept back (Preset.reserve_s), a phase may have a cap
(Preset.cap_s), and a process that overruns is killed, its partial result kept (a SIGTERM to
this process, a caller's time limit, also writes what was measured). See bench/gpu_check.sh
for the budget on an H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _datasets  # noqa: E402
from _gpu_e2e_checkpoint import checkpoint_folder, ensure_checkpoint  # noqa: E402
from _gpu_e2e_child_io import Result, write_json  # noqa: E402
from _gpu_e2e_hf import child_hf  # noqa: E402
from _gpu_e2e_jaxserve import child_cold, child_warm  # noqa: E402
from _gpu_e2e_presets import PRESETS, PUBLISHED_VLLM, Preset  # noqa: E402
from _gpu_e2e_report import build_summary, print_table  # noqa: E402
from _metrics import ModelShape  # noqa: E402

DEFAULT_CACHE = HERE / ".cache" / "gpu_e2e"


CHILDREN = {"cold": child_cold, "warm": child_warm, "hf": child_hf}
# In this order: transformers before the warm start, so that the warm start (the least
# important figure, and the one that takes what it takes) gets the time left over.
PHASES = ("cold", "hf", "warm")


def child_main(phase: str, spec_path: str, result_path: str) -> NoReturn:
    spec = json.loads(Path(spec_path).read_text())
    res = Result(result_path)
    res.update(phase=phase, status="starting")
    res.save()
    try:
        CHILDREN[phase](spec, res)
        code = 0
    except BaseException as e:  # recorded, then the process fails
        res["status"] = "failed"
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-6000:]
        res.save()
        traceback.print_exc()
        code = 1
    # Skip the interpreter's teardown (freeing tens of GB of device buffers one by one): the
    # result is written, and the phase's time limit should not be spent on the exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- the orchestrating process ------------------------------------------------------------


class _Terminated(Exception):
    """SIGTERM (a caller's time limit): write what was measured, then exit."""


def _on_sigterm(signum, frame) -> None:
    # Once: `timeout` signals both this process and its process group.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Terminated()


def _run_child(phase: str, spec: dict, out_dir: Path, timeout_s: float, report: dict) -> dict:
    """Run one phase in a fresh process with a deadline; returns its result (partial if it
    overran) and records the phase's status, wall time and exit code in the report."""
    spec_path = out_dir / f"e2e_{phase}_spec.json"
    result_path = out_dir / f"e2e_{phase}.json"
    log_path = out_dir / f"e2e_{phase}.log"
    result_path.unlink(missing_ok=True)
    spec = dict(spec, t_spawn=time.time(), deadline=time.time() + timeout_s - 5)
    write_json(spec_path, spec)
    info = dict(timeout_s=round(timeout_s, 1), log=str(log_path), status="running")
    report["phases"][phase] = info
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", phase]
    cmd += ["--spec", str(spec_path), "--result", str(result_path)]
    t0 = time.perf_counter()
    print(f"[e2e] {phase}: up to {timeout_s:.0f} s (log {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout_s)
            info["status"] = "ok" if code == 0 else "failed"
            info["exit_code"] = code
        except subprocess.TimeoutExpired:
            info["status"] = "timeout"
            proc.kill()
            proc.wait()
        except BaseException:
            info["status"] = "terminated"
            proc.kill()
            proc.wait()
            raise
        finally:
            info["wall_s"] = round(time.perf_counter() - t0, 2)
            try:
                result = json.loads(result_path.read_text())
            except (OSError, ValueError):
                result = {}
            spec_path.unlink(missing_ok=True)
            report["results"][phase] = result
    if info["status"] != "ok":
        tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
        print(f"[e2e] {phase}: {info['status']}; log tail:\n{tail}", flush=True)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers override")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--hf-num-requests", type=int, default=None)
    p.add_argument("--hf-batch-size", type=int, default=None)
    p.add_argument("--engine-json", default=None, help="LLM keyword overrides, as JSON")
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="checkpoint cache folder")
    p.add_argument("--out", default="gpu_e2e.json", help="JSON report (per-phase files beside)")
    p.add_argument("--compile-cache", default=None, help="default: <out dir>/jax_compile_cache")
    p.add_argument("--budget-s", type=float, default=None, help="wall-time budget of the run")
    p.add_argument("--phases", default="cold,hf,warm", help="which of cold,hf,warm to run")
    p.add_argument("--checkpoint-only", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, args.spec, args.result)
    t_start = time.perf_counter()
    preset = PRESETS[args.preset]
    budget = args.budget_s if args.budget_s is not None else preset.budget_s
    deadline = time.time() + budget
    cfg = dict(preset.model)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out_dir = out.parent
    compile_cache = Path(args.compile_cache or out_dir / "jax_compile_cache")
    report: dict = dict(
        preset=preset.name,
        complete=False,
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
        budget_s=budget,
        machine=dict(hostname=platform.node(), cpus=os.cpu_count()),
        published=PUBLISHED_VLLM,
        phases={},
        results={},
    )
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        _run(args, preset, cfg, out, out_dir, compile_cache, deadline, report)
        report["complete"] = not args.checkpoint_only and all(
            p.get("status") == "ok" for p in report["phases"].values()
        )
    except _Terminated:
        report["terminated"] = "SIGTERM (the caller's time limit)"
        report["summary"] = build_summary(report)
        report["wall_s"] = time.perf_counter() - t_start
        write_json(out, report)
        sys.exit(124)
    finally:
        signal.signal(signal.SIGTERM, previous)
    report["wall_s"] = time.perf_counter() - t_start
    if not args.checkpoint_only:
        report["summary"] = build_summary(report)
    write_json(out, report)
    if not args.checkpoint_only:
        print_table(report)
    print(f"wrote {out}", flush=True)
    return report


def _checkpoint_phase(folder: Path, cfg: dict, preset: Preset, seed: int, report: dict) -> bool:
    """Write (or reuse) the random checkpoint in `folder`, recorded in report["checkpoint"] and
    its phase; returns False when it could not be written (no disk space, an unwritable
    cache): then nothing can run."""
    print(f"[e2e] checkpoint {folder} ...", flush=True)
    t0 = time.perf_counter()
    try:
        report["checkpoint"] = dict(ensure_checkpoint(folder, cfg, preset, seed))
    except (OSError, RuntimeError) as e:  # no disk space, an unwritable cache: nothing to run
        error = f"{type(e).__name__}: {e}"
        report["checkpoint"] = dict(error=error)
        report["phases"]["checkpoint"] = dict(status="failed", error=error)
        print(f"[e2e] checkpoint: FAILED: {error}", flush=True)
        return False
    report["checkpoint"]["phase_s"] = time.perf_counter() - t0
    report["phases"]["checkpoint"] = dict(status="ok", wall_s=round(time.perf_counter() - t0, 2))
    ck = report["checkpoint"]
    print(
        f"[e2e] checkpoint: {ck['bytes'] / 1e9:.2f} GB, "
        + ("reused" if ck["reused"] else f"written in {ck['write_s']:.1f} s"),
        flush=True,
    )
    return True


def _run(args, preset, cfg, out, out_dir, compile_cache, deadline, report) -> None:
    folder = checkpoint_folder(Path(args.cache), preset, cfg)
    shape = ModelShape.from_hf_config(cfg)
    report["model"] = dict(
        config=cfg,
        num_params=dataclasses.replace(shape, bytes_per_param=2).num_params,
        checkpoint_dir=str(folder),
    )
    if not _checkpoint_phase(folder, cfg, preset, args.seed, report):
        return
    write_json(out, report)
    if args.checkpoint_only:
        return

    n = args.num_requests or preset.num_requests
    dataset = _datasets.sharegpt_like(n, cfg["vocab_size"], seed=args.seed, **preset.dataset_kw)
    report["dataset"] = dataset.summary()
    engine = dict(preset.engine, **json.loads(args.engine_json or "{}"))
    spec = dict(
        model_dir=str(folder),
        model_config=cfg,
        dtype=preset.dtype,
        engine=engine,
        compile_cache=str(compile_cache),
        requests=[[r.prompt_token_ids, r.output_len] for r in dataset.requests],
        num_requests_total=n,
        seed=args.seed,
        run_reserve_s=preset.run_reserve_s,
        warmup_requests=preset.warmup_requests,
        check_requests=preset.check_requests,
        hf_num_requests=min(args.hf_num_requests or preset.hf_num_requests, n),
        hf_batch_size=args.hf_batch_size or preset.hf_batch_size,
    )
    report["engine"] = engine
    report["compile_cache"] = str(compile_cache)
    phases = [p for p in PHASES if p in args.phases.split(",")]
    if "cold" in phases:  # cold means an empty persistent cache
        shutil.rmtree(compile_cache, ignore_errors=True)
    compile_cache.mkdir(parents=True, exist_ok=True)
    for i, phase in enumerate(phases):
        kept = sum(preset.reserve_s.get(p, 0.0) for p in phases[i + 1 :])
        timeout = min(deadline - time.time() - kept, preset.cap_s.get(phase, math.inf))
        if timeout < preset.min_phase_s:
            report["phases"][phase] = dict(status="skipped", reason=f"{timeout:.0f} s left")
            print(f"[e2e] {phase}: skipped, {timeout:.0f} s left", flush=True)
            continue
        _run_child(phase, spec, out_dir, timeout, report)
        report["summary"] = build_summary(report)
        write_json(out, report)
    report["compile_cache_bytes"] = sum(
        f.stat().st_size for f in compile_cache.rglob("*") if f.is_file()
    )
    report["summary"] = build_summary(report)


if __name__ == "__main__":
    main(sys.argv[1:])
