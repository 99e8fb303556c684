"""bench/batch.py's run: the inputs written once, each path in its own process, and the report
(ratios to the reference, token ids compared request by request).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _datasets
from _batch_presets import PRESETS, resolve_model
from _batch_report import goals
from _machine import git_state, loadavg, machine

# The entry script: each path runs as `batch.py --child KIND --spec FILE` from the repository root.
SCRIPT = Path(__file__).resolve().parent / "batch.py"
ROOT = SCRIPT.parent.parent


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
            str(SCRIPT),
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
