"""bench/startup.py's experiment 5: LLM(...) to the first token, phase by phase.

For each model (the built-in demo with its default engine, and bench/throughput.py's 57M
checkpoint with its engine), two fresh processes on one empty cache folder (first: nothing
cached; second: the compilation cache and the serialized executables of the first), each:

    import      spawn -> jax and jaxserve imported (trace / lower / compile: jax's seconds in
                the whole of LLM(...) -> first token, the weights' and the plan's included)
    config      resolve_model: config.json, the plan, the memory plan (twice: without the
                attention self-check, then with it while the weights load)
    weights     the checkpoint loaded onto the device (the demo's: generated), in the
                start-up's load thread (runner/startup.py): it overlaps the second config
                and the runner, so the phases add up to more than LLM(...)'s time
    runner      the ModelRunner: KV pool, host buffers, jitted functions
    warm-up     the shapes LLM's default warm-up compiles before the first request (the
                job's), split into jax's trace, lower and compile (fresh or from jax's cache)
                seconds and the executable store's load seconds
    first token LLM(...) built -> generate() of one prompt, max_tokens=1, returned
    rebuild     then in the same process, as a notebook re-running its cell:
                ``del llm; LLM(...)`` and the first token again

vLLM's CPU backend on the same 57M checkpoint, in the same run, when bench/startup.py is given
``--vllm-python`` (bench/_startup_vllm.py): its processes alternate with jaxserve's (jaxserve
first, vLLM first, then the second processes in turns, a drift hitting both alike), each on its
own compilation cache (vLLM's: empty for its first process). Without it the report compares
with the figure of the issue that asked for this, labelled as not the same run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _startup_vllm as vllm_side

VLLM_MODEL = "57m"  # the model vLLM runs too (the demo model is jaxserve's built-in)
PROMPT = [1, 300, 301, 302, 303, 304]  # token ids: the 57M checkpoint has no tokenizer
PHASES = ("import_s", "config_s", "weights_s", "runner_s", "warmup_s", "first_token_s")

CHILD = r"""
import gc, json, sys, threading, time
spawn = float(sys.argv[2])
import jax
import jaxserve.engine.llm as llm_module
import jaxserve.runner.executable_store as store
import jaxserve.runner.factory as factory
from jaxserve import LLM, SamplingParams
out = {"import_s": time.time() - spawn}
lock = threading.Lock()
acc = {}
def add(key, seconds):
    with lock:
        acc[key] = acc.get(key, 0.0) + seconds
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s"}
def on_duration(event, duration, **kw):
    if event in EVENTS:
        add(EVENTS[event], duration)
jax.monitoring.register_event_duration_secs_listener(on_duration)
def timed(owner, name, key):
    fn = getattr(owner, name)
    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            add(key, time.perf_counter() - start)
    setattr(owner, name, wrapper)
for owner, name, key in ((factory, "resolve_model", "config_s"),
                         (factory, "_load_weights", "weights_s"),
                         (factory, "make_runner", "runner_s"),
                         (llm_module, "warm_up_for", "warmup_s"),
                         (store.ExecutableStore, "load", "store_load_s")):
    timed(owner, name, key)
def first_token(engine):
    acc.clear()
    start = time.perf_counter()
    llm = LLM(**engine)
    built = time.perf_counter()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    done = time.perf_counter()
    stats = llm.get_stats()
    row = dict(acc, construct_s=built - start, first_token_s=done - built,
               to_first_token_s=done - start, fresh=stats["num_compilations"],
               cache_hits=stats["num_compilation_cache_hits"])
    return llm, row
spec = json.loads(sys.argv[1])
PROMPT = spec["prompt"]
llm, out["first"] = first_token(spec["engine"])
del llm
gc.collect()
llm, out["rebuild"] = first_token(spec["engine"])
print("RESULT " + json.dumps(out), flush=True)
"""


def _run(engine: dict, cache: str, env: dict) -> dict:
    spawn = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps({"engine": engine, "prompt": PROMPT}),
         repr(spawn)],
        capture_output=True, text=True, env=env, timeout=3600,
    )  # fmt: skip
    result = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or result is None:
        raise RuntimeError(f"phases process failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(result[len("RESULT ") :])
    out["wall_s"] = time.time() - spawn
    out["spawn_to_first_token_s"] = out["import_s"] + out["first"]["to_first_token_s"]
    return out


def order(compare: bool, repeats: int) -> list[tuple[str, int]]:
    """The processes of one model, (engine, index): jaxserve's first, vLLM's first, then
    ``repeats`` second processes each, alternated (j, v, v, j, ...); jaxserve's only when not
    ``compare``."""
    if repeats < 1:
        raise ValueError(f"phases repeats={repeats}: at least 1 second process is needed")
    sides = ("jaxserve", "vllm") if compare else ("jaxserve",)
    out = [(side, 0) for side in sides]
    for r in range(repeats):
        pair = sides if r % 2 == 0 else sides[::-1]
        out += [(side, r + 1) for side in pair]
    return out


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def phases(models: dict[str, dict], child_env, vllm: dict | None = None,
           repeats: int = 1) -> dict:  # fmt: skip
    """Experiment 5 for each of ``models`` (name -> LLM arguments): a first process and
    ``repeats`` second ones each on one fresh cache folder, vLLM's beside the 57M model's when
    ``vllm`` (bench/_startup_vllm.py's start()) is a same-run entry; None: the issue's figure.
    ``child_env(cache)`` is jaxserve's children's environment."""
    vllm = vllm_side.fallback() if vllm is None else vllm
    report: dict = {"models": {}, "vllm": vllm, "repeats": repeats}
    for name, engine in models.items():
        compare = vllm["same_run"] and name == VLLM_MODEL
        if compare:
            vllm["settings"] = vllm_side.settings(engine)
            spec = {"llm": vllm["settings"], "prompt": PROMPT}
        runs = []
        with (
            tempfile.TemporaryDirectory(prefix="startup-phases-") as cache,
            tempfile.TemporaryDirectory(prefix="startup-phases-vllm-") as vcache,
        ):
            sequence = order(compare, repeats)
            for i, (side, k) in enumerate(sequence):
                which = "first" if k == 0 else f"second {k}/{repeats}"
                print(f"  phases {name} {side} {which} ({i + 1}/{len(sequence)}) ...", flush=True)
                if side == "jaxserve":
                    runs.append(_run(engine, cache, child_env(cache)))
                else:
                    row = vllm_side.run(vllm["python"], spec, Path(vcache), vllm["env"])
                    vllm["runs"].append(row)
        second = mean(r["spawn_to_first_token_s"] for r in runs[1:])
        report["models"][name] = {
            "engine": engine,
            "runs": runs,
            "second_spawn_to_first_token_s": second,
            "second_to_first_token_s": mean(r["first"]["to_first_token_s"] for r in runs[1:]),
            "second_over_first": second / runs[0]["spawn_to_first_token_s"],
        }
        if compare:
            vllm_side.summarize(vllm)
    return report


def print_phases(report: dict) -> None:
    """The phase table: one row per model and process (and notebook rebuild)."""
    print("5 LLM(...) to the first token, by phase (seconds; default warm-up: the job's shapes)")
    cols = ("import", "config", "weights", "runner", "trace", "lower", "compile", "store",
            "warm-up", "1st tok", "LLM->tok", "spawn->tok")  # fmt: skip
    print(f"  {'model / process':<22}" + "".join(f"{c:>11}" for c in cols))
    for name, m in report["models"].items():
        for i, run in enumerate(m["runs"]):
            label = process_label(i, len(m["runs"]))
            for kind in ("first", "rebuild"):
                row = run[kind]
                cells = [
                    run["import_s"] if kind == "first" else None,
                    *(row.get(k, 0.0) for k in ("config_s", "weights_s", "runner_s")),
                    *(row.get(k, 0.0) for k in ("trace_s", "lower_s", "compile_s")),
                    row.get("store_load_s", 0.0),
                    row.get("warmup_s", 0.0),
                    row["first_token_s"],
                    row["to_first_token_s"],
                    run["spawn_to_first_token_s"] if kind == "first" else None,
                ]
                text = f"{name} {label}" + (" rebuild" if kind == "rebuild" else "")
                print(f"  {text:<22}" + "".join(_cell(c) for c in cells))
        print(f"  {name}: second / first process (spawn -> first token) "
              f"{m['second_over_first']:.2f}x")  # fmt: skip
    vllm_side.print_vllm(report["vllm"], report["models"].get(VLLM_MODEL))


def process_label(i: int, count: int) -> str:
    """first, second (second 1, second 2, ... when there are several)."""
    if i == 0:
        return "first"
    return "second" if count == 2 else f"second {i}"


def _cell(value: float | None) -> str:
    return f"{'-':>11}" if value is None else f"{value:>11.2f}"
