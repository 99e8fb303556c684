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

vLLM's CPU backend is compared where it is installed (``vllm`` importable); it is not on
this project's machines, so the report says so and compares with the figure of the issue that
asked for this (vLLM 0.32's CPU backend, LLM(...) on the same 57M checkpoint: 52.1 s).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time

# vLLM 0.32's CPU backend, LLM(...) on the 57M checkpoint (issue 35, this machine).
VLLM_CPU_ISSUE_S = 52.1
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


def phases(models: dict[str, dict], child_env) -> dict:
    """Experiment 5 for each of ``models`` (name -> LLM arguments): two processes each on one
    fresh cache folder. ``child_env(cache)`` is the children's environment."""
    report: dict = {"models": {}, "vllm": vllm_note()}
    for name, engine in models.items():
        runs = []
        with tempfile.TemporaryDirectory(prefix="startup-phases-") as cache:
            for i in range(2):
                print(f"  phases {name} process {i + 1}/2 ...", flush=True)
                runs.append(_run(engine, cache, child_env(cache)))
        first, second = runs
        report["models"][name] = {
            "engine": engine,
            "runs": runs,
            "second_over_first": second["spawn_to_first_token_s"] / first["spawn_to_first_token_s"],
        }
    return report


def vllm_note() -> dict:
    """Whether vLLM is installed here, and the issue's figure to compare with when not."""
    installed = importlib.util.find_spec("vllm") is not None
    return {
        "installed": installed,
        "note": "vLLM is installed: run bench/vllm_throughput.py for its CPU backend"
        if installed
        else "vLLM's CPU backend is not installed on this machine: compared with the issue's "
        f"figure (vLLM 0.32 CPU, LLM(...) on the 57M checkpoint: {VLLM_CPU_ISSUE_S} s)",
        "issue_llm_construct_s": VLLM_CPU_ISSUE_S,
    }


def print_phases(report: dict) -> None:
    """The phase table: one row per model and process (and notebook rebuild)."""
    print("5 LLM(...) to the first token, by phase (seconds; default warm-up: the job's shapes)")
    cols = ("import", "config", "weights", "runner", "trace", "lower", "compile", "store",
            "warm-up", "1st tok", "LLM->tok", "spawn->tok")  # fmt: skip
    print(f"  {'model / process':<22}" + "".join(f"{c:>11}" for c in cols))
    for name, m in report["models"].items():
        for label, run in zip(("first", "second"), m["runs"], strict=True):
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
    print(f"  {report['vllm']['note']}")


def _cell(value: float | None) -> str:
    return f"{'-':>11}" if value is None else f"{value:>11.2f}"
