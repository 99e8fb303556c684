"""`jaxserve compile --output` on the machine that will serve, then `LLM(precompiled=...)` there.

The check issue 33 asks for the first time an accelerator is at hand: executables compiled for a
named target (deviceless: the target's compile-only devices, CUDA_VISIBLE_DEVICES=-1) load into
an engine on the real chip, which then compiles nothing and generates what an engine that
compiled for itself generates. Three processes, one after the other (each holds the device):

    compile   `jaxserve compile --model M --target T <engine flags> --output STORE --json R`
    loaded    LLM(M, precompiled=STORE, <engine flags>): construct + warm-up time, its
              compilations (0 when every executable loaded) and cache hits, greedy tokens
    compiled  LLM(M, <engine flags>) with an empty compilation cache: the same, compiled here

The target is the one whose device_kind is the attached chip's (--target to name another).
The engine flags fix every size the manifest is keyed by (the KV pool's included: planned from
memory, it would differ between a compile-only device and the real one's allocator). Prints a
table and writes JSON (--out); exit status 0 when the loaded engine compiled nothing and its
tokens equal the compiled one's.

    python bench/precompiled_check.py --out precompiled.json
    python bench/precompiled_check.py --preset quick --target h100   # any machine with the compiler
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from throughput import CACHE, PRESETS, ensure_checkpoint

ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256,
          "block_size": 16, "num_kv_blocks": 256}  # fmt: skip
PROMPTS = [[(7 * i + 3 * j) % 500 + 10 for j in range(5 + 9 * i)] for i in range(6)]

SERVE = r"""
import json, sys, time
start = time.perf_counter()
from jaxserve import LLM, SamplingParams
model, precompiled, engine = sys.argv[1], sys.argv[2] or None, json.loads(sys.argv[3])
try:
    llm = LLM(model, precompiled=precompiled, warmup=True, **engine)
except (ValueError, FileNotFoundError) as e:  # a manifest that does not match: named
    print(json.dumps({"refused": f"{type(e).__name__}: {e}"}))
    sys.exit(0)
ready = time.perf_counter() - start
stats = llm.get_stats()
params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[4])]
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
gen = time.perf_counter() - t
after = llm.get_stats()
print(json.dumps(dict(
    ready_s=ready, generate_s=gen, plan=llm.engine.runner.plan.summary(),
    compilations=stats["num_compilations"], cache_hits=stats["num_compilation_cache_hits"],
    recompilations=[str(r) for r in after["recompilations"]],
    tokens=[o.outputs[0].token_ids for o in outs],
)))
"""


def _target_of_attached() -> str:
    """The target whose device_kind is the attached chip's (jax imported in a child, so that
    this process never holds the device)."""
    code = (
        "import jax; from jaxserve.aot.targets import TARGETS; k = jax.devices()[0].device_kind;"
        "print(next((n for n, t in TARGETS.items() if t.device_kind == k), 'none:' + k))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def _engine_flags() -> list[str]:
    return [a for k, v in ENGINE.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _serve(model: str, store: str, env: dict[str, str]) -> dict:
    argv = [sys.executable, "-c", SERVE, model, store, json.dumps(ENGINE), json.dumps(PROMPTS)]
    t = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:], "wall_s": time.perf_counter() - t}
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - t}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--target", help="default: the target of the attached chip")
    p.add_argument("--out", default="precompiled_check.json")
    args = p.parse_args(argv)
    model = str(ensure_checkpoint(PRESETS[args.preset], CACHE))
    target = args.target or _target_of_attached()
    report: dict = {"preset": args.preset, "target": target, "engine": ENGINE}
    if target.startswith("none:"):
        report["error"] = f"no target has the attached chip's device_kind {target[5:]!r}"
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(report["error"])
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        store, compiled_json = os.path.join(tmp, "store"), os.path.join(tmp, "compile.json")
        cmd = [sys.executable, "-m", "jaxserve.cli", "compile", "--model", model, "--target",
               target, *_engine_flags(), "--output", store, "--json", compiled_json]  # fmt: skip
        t = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        report["compile"] = {"exit_code": out.returncode, "wall_s": time.perf_counter() - t,
                             "stderr_tail": out.stderr[-1500:]}  # fmt: skip
        if os.path.exists(compiled_json):
            compiled = json.loads(Path(compiled_json).read_text())
            report["compile"]["buckets"] = len(compiled["buckets"])
            report["compile"]["ok"] = compiled.get("ok")
            report["compile"]["executables"] = len(list(Path(store).glob("*.bin")))
        for name, folder in (("loaded", store), ("compiled", "")):
            cache = os.path.join(tmp, f"cache_{name}")  # empty: nothing from an earlier run
            env = {**os.environ, "JAXSERVE_COMPILATION_CACHE_DIR": cache}
            report[name] = _serve(model, folder, env)
    loaded, compiled = report["loaded"], report["compiled"]
    report["ok"] = bool(
        loaded.get("compilations") == 0 and loaded.get("cache_hits", 0) > 0
        and not loaded.get("recompilations") and "tokens" in compiled
        and loaded.get("tokens") == compiled["tokens"]
    )  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=1))
    _print(report)
    return 0 if report["ok"] else 1


def _print(r: dict) -> None:
    c = r["compile"]
    print(f"target {r['target']}, preset {r['preset']}, engine {r['engine']}")
    print(f"compile: exit {c['exit_code']}, {c['wall_s']:.1f} s, {c.get('buckets')} buckets, "
          f"{c.get('executables')} executables written")  # fmt: skip
    if c["exit_code"] != 0:
        print(c["stderr_tail"])
    for name in ("loaded", "compiled"):
        e = r[name]
        if "tokens" in e:
            print(f"{name:9} ready {e['ready_s']:6.1f} s  compilations {e['compilations']:3d}  "
                  f"cache hits {e['cache_hits']:3d}  recompilations {len(e['recompilations'])}  "
                  f"generate {e['generate_s']:.2f} s  plan: {e['plan']}")  # fmt: skip
        else:
            print(f"{name:9} {e.get('refused') or e.get('error', '')[-1500:]}")
    same = "tokens" in r["loaded"] and r["loaded"]["tokens"] == r["compiled"].get("tokens")
    print(f"same greedy tokens: {same}; ok: {r['ok']}")


if __name__ == "__main__":
    sys.exit(main())
