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
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _datasets  # noqa: E402
from _machine import git_state, loadavg, machine  # noqa: E402

CACHE = HERE / ".cache"
RESULTS = HERE / "results"
JAX_PATHS = ("generate", "run-batch", "generate-cli")  # must agree token for token


@dataclass(frozen=True)
class Preset:
    model: str  # a built-in model, or "checkpoint:<bench/throughput.py preset>"
    vocab_size: int
    engine: dict  # LLM keyword arguments (dtype, seed and the cache folder are added)
    num_requests: int
    dataset_kw: dict = field(default_factory=dict)
    ray: bool = True
    bracket: bool = True
    child_timeout_s: float = 1800.0


PRESETS = {
    # bench/throughput.py's default: llama-57m and its engine settings.
    "default": Preset(
        model="checkpoint:default",
        vocab_size=32000,
        engine=dict(
            block_size=32,
            num_kv_blocks=4096 + 1,  # 4096 usable + the null block, as bench/_jaxserve_runs.py
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            max_model_len=2048,
        ),
        num_requests=128,
    ),
    # For tests/bench: seconds per path.
    "tiny": Preset(
        model="tiny-random-llama",
        vocab_size=1024,
        engine=dict(
            block_size=8,
            num_kv_blocks=64,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=128,
        ),
        num_requests=12,
        dataset_kw=dict(mean_input=12, mean_output=10, max_prompt_len=40, max_total_len=64),
        ray=False,
        bracket=False,
        child_timeout_s=300.0,
    ),
}

# CLI flag of each LLM keyword argument the presets use.
_FLAGS = {
    "dtype": "--dtype",
    "block_size": "--block-size",
    "num_kv_blocks": "--num-kv-blocks",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "compilation_cache_dir": "--compilation-cache-dir",
    "seed": "--seed",
}


def resolve_model(preset: Preset, cache: Path) -> str:
    if not preset.model.startswith("checkpoint:"):
        return preset.model
    import throughput  # its checkpoint presets and ensure_checkpoint

    return str(
        throughput.ensure_checkpoint(throughput.PRESETS[preset.model.split(":", 1)[1]], cache)
    )


# ---- the children --------------------------------------------------------------------------


def _compiles(engine) -> int:
    """Step compilations so far, fresh or loaded from the persistent cache (either: a new shape),
    of an LLM or an AsyncLLM (their get_stats())."""
    stats = engine.get_stats()
    return stats["num_compilations"] + stats["num_compilation_cache_hits"]


def _requests(spec: dict) -> list[tuple[list[int], int]]:
    return [
        (r["prompt_token_ids"], r["output_len"])
        for r in json.loads(Path(spec["requests"]).read_text())
    ]


def _engine_flags(engine: dict) -> list[str]:
    """The CLI flags of LLM keyword arguments."""
    flags = []
    for k, v in engine.items():
        if k == "warmup":
            flags += [] if v else ["--no-warmup"]
        else:
            flags += [_FLAGS[k], str(v)]
    return flags


def child_generate(spec: dict) -> dict:
    """The reference: LLM built (untimed), then one timed LLM.generate call."""
    t0 = time.perf_counter()
    from jaxserve import LLM, SamplingParams

    llm = LLM(spec["model"], **{"warmup": True, **spec["engine"]})  # warm before timing
    build_s = time.perf_counter() - t0
    reqs = _requests(spec)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    before = _compiles(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "build_s": build_s,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "compilations_during_run": _compiles(llm) - before,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }


def child_run_batch(spec: dict) -> dict:
    """`jaxserve run-batch` through jaxserve.cli.main, with two wrappers that only record: the
    job's compilations and elapsed (around jobs.run_batch.run_batch) and each request's final
    token ids (around AsyncLLM.generate; the output file has texts only)."""
    t0 = time.perf_counter()
    import jaxserve.jobs.run_batch as rb
    from jaxserve import cli
    from jaxserve.engine.async_llm import AsyncLLM

    info: dict = {}
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    original_generate, original_run_batch = AsyncLLM.generate, rb.run_batch

    async def generate(self, prompt, sampling_params, request_id, **kw):
        async for out in original_generate(self, prompt, sampling_params, request_id, **kw):
            if out.finished:
                by_prompt[tuple(out.prompt_token_ids)] = list(out.outputs[0].token_ids)
            yield out

    async def run_batch(engine, *args, **kw):
        info["startup_s"] = time.perf_counter() - t0  # imports, input, engine build
        before = _compiles(engine)
        summary = await original_run_batch(engine, *args, **kw)
        info["compilations_during_run"] = _compiles(engine) - before
        info["summary"] = dict(vars(summary))
        return summary

    AsyncLLM.generate, rb.run_batch = generate, run_batch
    rc = cli.main(
        [
            "run-batch",
            "-i",
            spec["input"],
            "-o",
            spec["output"],
            "--model",
            spec["model"],
            "--served-model-name",
            spec["served_model_name"],
            "--no-progress",
            *_engine_flags(spec["engine"]),
        ]
    )
    info["rc"] = rc
    info["token_ids"] = [by_prompt.get(tuple(ids)) for ids, _ in _requests(spec)]
    return info


def child_generate_cli(spec: dict) -> dict:
    """`jaxserve generate --input --output` through jaxserve.cli.main; the job's generate
    (jobs/generate.py) is wrapped to record the compilations of the timed part."""
    from jaxserve import cli
    from jaxserve.jobs import generate as job
    from jaxserve.jobs.job_spec import is_header

    info: dict = {}
    original = job.generate

    def generate(llm, requests, results, **kw):
        before = _compiles(llm)
        outputs, elapsed_s = original(llm, requests, results, **kw)
        info["compilations_during_run"] = _compiles(llm) - before
        info["elapsed_s_exact"] = elapsed_s
        return outputs, elapsed_s

    job.generate = generate
    rc = cli.main(
        [
            "generate",
            "--input",
            spec["input"],
            "--output",
            spec["output"],
            "--model",
            spec["model"],
            "--temperature",
            "0",
            "--ignore-eos",
            "--no-progress",
            *_engine_flags(spec["engine"]),
        ]
    )
    info["rc"] = rc
    by_id = {}
    for line in Path(spec["output"]).read_text().splitlines():
        record = json.loads(line)
        if not is_header(record):  # the job's header line comes first
            by_id[record["request_id"]] = record["token_ids"]
    info["token_ids"] = [by_id.get(f"r{i}") for i in range(len(_requests(spec)))]
    return info


def child_ray(spec: dict) -> dict:
    """build_processor(concurrency=N) over the rows on a local Ray cluster; the whole dataset
    execution is timed (actor start and engine build included)."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback node address
    import ray
    import ray.data

    from jaxserve.ray import build_processor

    t0 = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=spec["ray_num_cpus"],
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=256 << 20,
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    init_s = time.perf_counter() - t0
    try:
        reqs = _requests(spec)
        rows = [
            {"id": i, "prompt_token_ids": ids, "sampling_params": {"max_tokens": n}}
            for i, (ids, n) in enumerate(reqs)
        ]
        processor = build_processor(
            spec["model"],
            engine_kwargs=spec["engine"],
            sampling_params=dict(temperature=0.0, ignore_eos=True),
            concurrency=spec["concurrency"],
            batch_size=spec["batch_size"],
        )
        ds = ray.data.from_items(rows)
        start = time.perf_counter()
        out = processor(ds).take_all()
        wall = time.perf_counter() - start
    finally:
        ray.shutdown()
    by_id = {row["id"]: [int(t) for t in row["generated_token_ids"]] for row in out}
    return {
        "elapsed_s": wall,
        "ray_init_s": init_s,
        "output_tokens": sum(int(row["num_generated_tokens"]) for row in out),
        "token_ids": [by_id.get(i) for i in range(len(reqs))],
    }


CHILDREN = {
    "generate": child_generate,
    "run-batch": child_run_batch,
    "generate-cli": child_generate_cli,
    "ray": child_ray,
}


def child_main(kind: str, spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = CHILDREN[kind](spec)
    Path(spec["result"]).write_text(json.dumps(result))
    return int(result.get("rc", 0))


def _with_run_batch_summary(r: dict) -> dict:
    """A run-batch child's result with the figures of the summary line it printed, or a
    failure when it printed none."""
    m = re.search(r"output tokens: (\d+) in ([\d.]+) s", r["stdout"])
    if not m:
        return {"failed": "no summary line", "output_tail": r["stdout"][-1500:]}
    r["summary_line"] = m.group(0)
    r["output_tokens"] = int(m.group(1))
    r["elapsed_s"] = r["summary"]["elapsed_s"]  # the number the line prints
    r["build_s"] = r.pop("startup_s")
    return r


def _with_generate_cli_summary(r: dict) -> dict:
    """A generate-cli child's result with the figures of the summary it printed, or a
    failure when it printed none."""
    out = re.search(r"output tokens:\s+(\d+)", r["stdout"])
    el = re.search(r"elapsed:\s+([\d.]+) s \(model load ([\d.]+) s", r["stdout"])
    tp = re.search(r"output throughput:\s+([\d.]+)", r["stdout"])
    if not (out and el and tp):
        return {"failed": "no summary", "output_tail": r["stdout"][-1500:]}
    r["summary_line"] = f"{el.group(0)}; {tp.group(0)}"
    r["output_tokens"] = int(out.group(1))
    r["elapsed_s"] = r.pop("elapsed_s_exact")  # the number `elapsed` prints
    r["build_s"] = float(el.group(2))
    r["printed_output_tokens_per_s"] = float(tp.group(1))
    return r


def _compare_token_ids(reference_ids: list, ids: list) -> dict:
    """How a path's token ids (one list per request) differ from the reference's: the
    mismatched requests (the first 20 named) and where the first of them diverges."""
    bad = [i for i, (a, b) in enumerate(zip(reference_ids, ids, strict=True)) if a != b]
    entry = {
        "num_requests": len(ids),
        "mismatched_requests": len(bad),
        "mismatched_ids": bad[:20],
    }
    if bad:
        i = bad[0]
        a, b = reference_ids[i], ids[i] or []
        diff = (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        pos = next(diff, min(len(a), len(b)))
        entry["first_mismatch"] = {
            "request": i,
            "position": pos,
            "len_ref": len(a),
            "len_path": len(b),
        }
    return entry


# ---- the parent ----------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.preset = PRESETS[args.preset]
        cache = Path(args.cache)
        self.model = resolve_model(self.preset, cache)
        self.engine = dict(
            dtype="float32",
            seed=args.seed,
            compilation_cache_dir=str(cache / "jax"),
            **self.preset.engine,
        )
        if args.no_warmup:
            self.engine["warmup"] = False
        self.dataset = _datasets.build(
            "sharegpt",
            args.num_requests or self.preset.num_requests,
            self.preset.vocab_size,
            self.engine["block_size"],
            seed=args.seed,
            **self.preset.dataset_kw,
        )
        self.served_model_name = Path(self.model).name
        self.work = Path(tempfile.mkdtemp(prefix="jaxserve-batch-bench-"))
        self.paths: dict[str, dict] = {}
        self.load = {"start": loadavg()}

    # inputs, written once: every path reads the same requests
    def write_inputs(self) -> None:
        reqs = self.dataset.requests
        (self.work / "requests.json").write_text(
            json.dumps(
                [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in reqs]
            )
        )
        with open(self.work / "batch.jsonl", "w") as f:
            for i, r in enumerate(reqs):
                body = {
                    "model": self.served_model_name,
                    "prompt": r.prompt_token_ids,
                    "max_tokens": r.output_len,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                line = {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": body,
                }
                f.write(json.dumps(line) + "\n")
        with open(self.work / "prompts.jsonl", "w") as f:
            for i, r in enumerate(reqs):
                line = {
                    "request_id": f"r{i}",
                    "prompt_token_ids": r.prompt_token_ids,
                    "max_tokens": r.output_len,
                }
                f.write(json.dumps(line) + "\n")

    def child(self, name: str, kind: str, **spec) -> dict:
        """Run one path in a fresh interpreter; its result dict, with its stdout kept."""
        spec = dict(
            model=self.model,
            engine=self.engine,
            requests=str(self.work / "requests.json"),
            result=str(self.work / f"{name}.result.json"),
            **spec,
        )
        spec_path = self.work / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            kind,
            "--spec",
            str(spec_path),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        print(f"  {name}: running (load {loadavg()[0]}) ...", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd,
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=self.args.child_timeout or self.preset.child_timeout_s,
            )
        except subprocess.TimeoutExpired as e:
            return {"failed": f"timed out after {e.timeout:.0f} s"}
        process_s = time.perf_counter() - t0
        result_file = Path(spec["result"])
        if proc.returncode != 0 or not result_file.exists():
            tail = (proc.stdout[-1500:] + "\n" + proc.stderr[-3000:]).strip()
            return {"failed": f"exit status {proc.returncode}", "output_tail": tail}
        result = json.loads(result_file.read_text())
        result["process_s"] = process_s
        result["stdout"] = proc.stdout
        return result

    def run_path(self, name: str) -> None:
        t = {"loadavg_before": loadavg()}
        if name in ("generate", "generate-again"):
            r = self.child(name, "generate")
            timed = "the LLM.generate call (engine build and warm-up excluded)"
        elif name == "run-batch":
            r = self.child(
                name,
                "run-batch",
                input=str(self.work / "batch.jsonl"),
                output=str(self.work / "run-batch.out.jsonl"),
                served_model_name=self.served_model_name,
            )
            timed = "the job (run_batch; engine build excluded), from its summary line"
            if "failed" not in r:
                r = _with_run_batch_summary(r)
        elif name == "generate-cli":
            r = self.child(
                name,
                "generate-cli",
                input=str(self.work / "prompts.jsonl"),
                output=str(self.work / "generate-cli.out.jsonl"),
            )
            timed = "its summary's elapsed (model load excluded)"
            if "failed" not in r:
                r = _with_generate_cli_summary(r)
        else:  # ray-N
            n = int(name.split("-")[1])
            batch_size = self.args.ray_batch_size or math.ceil(len(self.dataset.requests) / n)
            r = self.child(
                name,
                "ray",
                concurrency=n,
                batch_size=batch_size,
                ray_num_cpus=self.args.ray_num_cpus,
            )
            r["concurrency"], r["batch_size"] = n, batch_size
            timed = (
                "the whole dataset execution: actor start-up and each actor's engine build "
                "(warm-up included) are IN it"
            )
        r.pop("stdout", None)
        r.update(t, timed=timed, loadavg_after=loadavg())
        if "failed" not in r:
            r["output_tokens_per_s"] = r["output_tokens"] / max(r["elapsed_s"], 1e-9)
            print(
                f"  {name}: {r['output_tokens']} tokens in {r['elapsed_s']:.2f} s = "
                f"{r['output_tokens_per_s']:.1f} out tok/s",
                flush=True,
            )
        else:
            print(f"  {name}: FAILED: {r['failed']}\n{r.get('output_tail', '')}", flush=True)
        self.paths[name] = r

    def run_all(self) -> None:
        a = self.args
        self.write_inputs()
        order = ["generate", "run-batch", "generate-cli"]
        if a.bracket:
            order.append("generate-again")
        self.ray_skipped = None
        if a.ray:
            if importlib.util.find_spec("ray") is None:
                self.ray_skipped = "ray is not importable (pip install 'jaxserve[ray]')"
            else:
                order += ["ray-1", "ray-2"]
        self.order = order
        print(
            f"{len(self.dataset.requests)} requests, {self.dataset.num_output_tokens} output "
            f"tokens; model {self.model}; paths {', '.join(order)}",
            flush=True,
        )
        for name in order:
            self.run_path(name)
        self.load["end"] = loadavg()

    # ---- report -------------------------------------------------------------------------------

    def report(self, wall_s: float) -> dict:
        paths = self.paths
        ref_names = [
            n for n in ("generate", "generate-again") if "output_tokens_per_s" in paths.get(n, {})
        ]
        ref_tps = [paths[n]["output_tokens_per_s"] for n in ref_names]
        ref = sum(ref_tps) / len(ref_tps) if ref_tps else None
        expected = self.dataset.num_output_tokens
        reference_ids = paths.get("generate", {}).get("token_ids")
        tokens: dict[str, dict] = {}
        for name, r in paths.items():
            if "output_tokens_per_s" in r and ref and not name.startswith("ray"):
                r["x_generate"] = r["output_tokens_per_s"] / ref
            ids = r.pop("token_ids", None)
            if ids is None or reference_ids is None or name == "generate":
                continue
            tokens[name] = _compare_token_ids(reference_ids, ids)
            r["token_id_mismatches"] = tokens[name]["mismatched_requests"]
        ray = self._ray_summary()
        report = {
            "preset": self.args.preset,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(self.load),
            "git": git_state(),
            "model": self.model,
            "engine": {k: v for k, v in self.engine.items()},
            "sampling": {
                "temperature": 0.0,
                "ignore_eos": True,
                "max_tokens": "each request's output_len",
            },
            "dataset": self.dataset.summary(),
            "expected_output_tokens": expected,
            "order": self.order,
            "paths": paths,
            "reference": {
                "paths": ref_names,
                "output_tokens_per_s": ref,
                "runs": ref_tps,
                "spread": (max(ref_tps) - min(ref_tps)) / ref if ref and len(ref_tps) > 1 else None,
            },
            "token_ids": {"reference": "generate", "paths": tokens},
            "ray": ray,
            "wall_s": wall_s,
        }
        report["goals"] = goals(report)
        report["notes"] = self._notes(report)
        return report

    def _ray_summary(self) -> dict:
        if self.ray_skipped:
            return {"skipped": self.ray_skipped}
        r1, r2 = self.paths.get("ray-1"), self.paths.get("ray-2")
        if r1 is None:
            return {"skipped": "not run (the tiny preset runs Ray only with --ray)"}
        out = {"num_cpus": self.args.ray_num_cpus}
        if r1 and r2 and "output_tokens_per_s" in r1 and "output_tokens_per_s" in r2:
            out["actors_2_vs_1"] = r2["output_tokens_per_s"] / r1["output_tokens_per_s"]
        build = self.paths.get("generate", {}).get("build_s")
        if build is not None:
            out["one_engine_build_s"] = build  # as the reference child measured it
            # Rough: the wall less one engine build (the 2 actors build theirs at the same time,
            # on the same cores, so their builds overlap and each takes longer than this).
            for name, r in (("ray-1", r1), ("ray-2", r2)):
                if r and "output_tokens_per_s" in r and r["elapsed_s"] > build:
                    out[f"{name}_approx_tok_s_less_one_build"] = r["output_tokens"] / (
                        r["elapsed_s"] - build
                    )
        return out

    def _notes(self, report: dict) -> list[str]:
        cpus = os.cpu_count()
        notes = [
            "Each path ran in a fresh process; compilations come from the shared persistent "
            f"cache ({self.engine['compilation_cache_dir']}); 'comp' counts the engine's step "
            "compilations (fresh + loaded from the cache) during the timed part.",
            "generate, run-batch, generate-cli: engine build and warm-up are not timed. Ray: "
            "the wall time of the dataset execution, which includes starting the actors and "
            "building (and warming up) one engine per actor, so it is not comparable as is "
            "with the others; one engine build took "
            f"{report['ray'].get('one_engine_build_s', float('nan')):.1f} s in the reference "
            "child.",
            f"This machine has {cpus} cores: Ray's 2 actors share them (each engine's XLA "
            "uses every core), so 2 actors vs 1 cannot exceed ~1x here; the 2-actor run "
            "also builds two engines at once on the same cores. Scaling needs one device "
            "(or core set) per actor.",
        ]
        if self.args.no_warmup:
            notes.append(
                "--no-warmup: each step shape compiles (or loads) when first used, inside the "
                "timed part."
            )
        return notes


def goals(report: dict) -> list[dict]:
    out = []

    def goal(text: str, value, target: float, higher: bool = True) -> None:
        holds = value is not None and (value >= target if higher else value <= target)
        out.append({"goal": text, "target": target, "measured": value, "holds": bool(holds)})

    goal(
        "run-batch / LLM.generate output tok/s >= 0.95",
        report["paths"].get("run-batch", {}).get("x_generate"),
        0.95,
    )
    tok = report["token_ids"]["paths"]
    agree = [p for p in JAX_PATHS if p != "generate"]
    mismatches = None
    if all(p in tok for p in agree):
        mismatches = sum(tok[p]["mismatched_requests"] for p in agree)
    goal(
        "generate / run-batch / generate-cli: greedy token ids differ in 0 requests",
        mismatches,
        0,
        higher=False,
    )
    return out


def print_table(report: dict) -> None:
    ds = report["dataset"]
    print(
        f"\nmodel {report['model']}, {ds['num_requests']} requests (prompt mean "
        f"{ds['prompt_len_mean']:.0f}, output mean {ds['output_len_mean']:.0f}, "
        f"{ds['num_output_tokens']} output tokens), greedy, ignore_eos; "
        f"{report['machine']['cpus']} cores, load avg start "
        f"{report['machine']['loadavg']['start']} end {report['machine']['loadavg'].get('end')}"
    )
    head = (
        f"{'path':15s} {'out tokens':>10s} {'timed s':>8s} {'out tok/s':>9s} {'x gen':>6s} "
        f"{'build s':>7s} {'comp':>4s} {'ids !=':>6s}  timed part"
    )
    print(head)
    print("-" * (len(head) + 40))
    for name, r in report["paths"].items():
        if "failed" in r:
            print(f"{name:15s} FAILED: {r['failed']}")
            continue
        build = r.get("build_s")
        comp = r.get("compilations_during_run")
        print(
            f"{name:15s} {r['output_tokens']:10d} {r['elapsed_s']:8.2f} "
            f"{r['output_tokens_per_s']:9.1f} {_fmt(r.get('x_generate'), 6, 3)} "
            f"{_fmt(build, 7, 1)} {_fmt(comp, 4, 0)} {_fmt(r.get('token_id_mismatches'), 6, 0)}  "
            f"{r['timed']}"
        )
    ref = report["reference"]
    if ref["spread"] is not None:
        print(
            f"reference = mean of {ref['paths']} ({ref['output_tokens_per_s']:.1f} tok/s, "
            f"spread {ref['spread']:.1%})"
        )
    ray = report["ray"]
    if "skipped" in ray:
        print(f"ray: skipped: {ray['skipped']}")
    elif "actors_2_vs_1" in ray:
        print(
            f"ray: 2 actors / 1 actor = {ray['actors_2_vs_1']:.2f}x (wall incl. actor start and "
            f"engine builds; one build ~{ray.get('one_engine_build_s', float('nan')):.0f} s; "
            f"{report['machine']['cpus']} cores shared by the actors)"
        )
    print(
        "'build s': engine build + warm-up (run-batch: whole start-up before the job); 'comp': "
        "step compilations in the timed part;\n'ids !=': requests whose token ids differ from "
        "generate's"
    )
    for g in report["goals"]:
        mark = "OK  " if g["holds"] else "MISS"
        m = g["measured"]
        print(f"  [{mark}] {g['goal']}: measured {m if m is None else format(m, '.3g')}")


def _fmt(v, width: int, digits: int) -> str:
    return f"{v:{width}.{digits}f}" if v is not None else f"{'-':>{width}s}"


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
