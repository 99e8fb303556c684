"""The measured process of bench/startup.py's experiments 1-4 (run as ``python -c CHILD
SPEC``): it prints one line ``RESULT {json}`` last."""

# argv[1]: the spec (JSON). Prints one line "RESULT {json}" last.
CHILD = r"""
import json, sys, threading, time
T = {"start": time.time()}
import jax

# No cache folder of the user's: jaxserve sets the one of $JAXSERVE_COMPILATION_CACHE_DIR.
assert not jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_dir

# Process-wide: every XLA compilation (jax's backend-compile event, cache hits included) and
# whether the persistent cache answered it (its hit event comes first, in the same thread).
# compile_s: seconds in jax's compile-or-load (both); cache_retrieval_s: of which loading.
PROC = {"compilations": 0, "cache_hits": 0, "fresh": 0, "fresh_names": [], "compile_s": 0.0,
        "cache_retrieval_s": 0.0}
_tls, _lock = threading.local(), threading.Lock()

def _on_event(event, **kw):
    if event == "/jax/compilation_cache/cache_hits":
        _tls.hit = True

def _on_duration(event, duration, **kw):
    if event == "/jax/compilation_cache/cache_retrieval_time_sec":
        with _lock:
            PROC["cache_retrieval_s"] += duration
    if event != "/jax/core/compile/backend_compile_duration":
        return
    hit, _tls.hit = getattr(_tls, "hit", False), False
    with _lock:
        PROC["compilations"] += 1
        PROC["compile_s"] += duration
        if hit:
            PROC["cache_hits"] += 1
        else:
            PROC["fresh"] += 1
            PROC["fresh_names"].append(str(kw.get("fun_name", "?")))

jax.monitoring.register_event_listener(_on_event)
jax.monitoring.register_event_duration_secs_listener(_on_duration)

def proc_snapshot():
    with _lock:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in PROC.items()}

def proc_delta(before):
    now = proc_snapshot()
    keys = ("compilations", "cache_hits", "fresh", "compile_s", "cache_retrieval_s")
    out = {k: now[k] - before[k] for k in keys}
    out["fresh_names"] = now["fresh_names"][len(before["fresh_names"]):]
    return out

def engine_counts(runner):
    return runner.num_compilations, runner.num_compilation_cache_hits

spec = json.loads(sys.argv[1])
mode = spec["mode"]
import jaxserve.cli.generate
import jaxserve.runner.factory as factory
from jaxserve import LLM, SamplingParams
T["imported"] = time.time()
out = {"mode": mode}

# The warm-ups: LLM(warmup=True)'s inside LLM(...) (warmup.ServerWarmup: its compile, which
# may overlap the weight load, and its run once on the loaded weights), and the default one of
# each job (engine/llm.py's warm_up_for: jaxserve generate's), summed.
import jaxserve.engine.llm as llm_module
import jaxserve.runner.warmup as warmup_module
WARM = {}
LOAD = {"weights_s": 0.0}  # factory._load_weights (in the start-up's load thread)
def _timed_load(fn):
    def wrapper(*args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            LOAD["weights_s"] += time.perf_counter() - start
    return wrapper
factory._load_weights = _timed_load(factory._load_weights)
def _timed(owner, name, runner_of, workers_of):
    fn = getattr(owner, name)
    def wrapper(*args):
        runner = runner_of(args)
        fresh, hits = engine_counts(runner)
        before = proc_snapshot()
        start = time.perf_counter()
        result = fn(*args)
        proc = proc_delta(before)
        new = dict(warmup_s=time.perf_counter() - start,
                   fresh=runner.num_compilations - fresh,
                   cache_hits=runner.num_compilation_cache_hits - hits,
                   compile_s=proc["compile_s"], cache_retrieval_s=proc["cache_retrieval_s"])
        for k, v in new.items():
            WARM[k] = WARM.get(k, 0) + v
        WARM["workers"] = workers_of(args)
        return result
    setattr(owner, name, wrapper)
_timed(warmup_module.ServerWarmup, "compile", lambda args: args[1], lambda args: args[0].workers)
_timed(warmup_module.ServerWarmup, "run", lambda args: args[1], lambda args: args[0].workers)
_timed(llm_module, "warm_up_for", lambda args: args[0].runner,
       lambda args: args[0].info.plan.compile_workers)
# A job handed to the construction (jaxserve generate: LLM(warmup_for=...)) compiles its set
# while the weights load (runner/job_startup.py); a tree without it times none.
try:
    import jaxserve.runner.job_startup as job_startup_module
except ImportError:
    job_startup_module = None
if job_startup_module is not None:
    _timed(job_startup_module.JobStartupWarmup, "compile", lambda args: args[1],
           lambda args: args[0].workers)
    _timed(job_startup_module.JobStartupWarmup, "run", lambda args: args[1],
           lambda args: args[0].workers)

if mode == "demo":
    stats = {}
    _get_stats = LLM.get_stats
    def get_stats(self):
        s = _get_stats(self)
        stats.update(s)
        return s
    LLM.get_stats = get_stats
    # `jaxserve generate` as jaxserve.cli.main runs it, with only that subcommand's parser:
    # another subcommand's import cannot break (or slow) the demo.
    import argparse
    parser = argparse.ArgumentParser(prog="jaxserve")
    jaxserve.cli.generate.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(spec["argv"])
    out["rc"] = args.run(args)
    out["engine"] = {"fresh": stats["num_compilations"],
                     "cache_hits": stats["num_compilation_cache_hits"],
                     "recompilations": stats["recompilations"]}
    out["warmup"] = WARM
    out["weights_s"] = LOAD["weights_s"]
elif mode == "construct":
    if spec.get("weights_first"):  # the start-up before runner/startup.py: load, then compile
        factory._weights_first = lambda resolved: True
    start = time.perf_counter()
    llm = LLM(**spec["engine"], warmup=True)
    out["construct_s"] = time.perf_counter() - start
    fresh, hits = engine_counts(llm.engine.runner)
    out["engine"] = {"fresh": fresh, "cache_hits": hits}
    out["warmup"] = WARM
    out["weights_s"] = LOAD["weights_s"]
elif mode == "workers":
    start = time.perf_counter()
    llm = LLM(**spec["engine"], warmup=False)
    out["construct_s"] = time.perf_counter() - start
    runner = llm.engine.runner
    before = proc_snapshot()
    start = time.perf_counter()
    num = runner.warmup(workers=spec["workers"])
    out["warmup_s"] = time.perf_counter() - start
    fresh, hits = engine_counts(runner)
    out["engine"] = {"compilations": num, "fresh": fresh, "cache_hits": hits}
    out["warmup_process"] = proc_delta(before)
elif mode == "features":
    llm = LLM(**spec["engine"], warmup=True)
    out["warmup"] = WARM
    rows = {}
    for name, prompts, params in spec["runs"]:
        if isinstance(params, list):
            sampling = [SamplingParams(**{"max_tokens": 16, **p}) for p in params]
        else:
            sampling = SamplingParams(**{"max_tokens": 16, **params})
        s0, p0 = llm.get_stats(), proc_snapshot()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        s1 = llm.get_stats()
        rows[name] = {
            "fresh": s1["num_compilations"] - s0["num_compilations"],
            "cache_hits": s1["num_compilation_cache_hits"] - s0["num_compilation_cache_hits"],
            "recompilations": s1["recompilations"][len(s0["recompilations"]):],
            "process": proc_delta(p0),
            "completions": sum(len(o.outputs) for o in outputs),
            "output_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs),
        }
    out["features"] = rows
elif mode == "server":  # a server's start: AsyncLLM(...) to a first request's first token
    import asyncio
    from jaxserve import AsyncLLM
    start = time.perf_counter()
    server = AsyncLLM(**spec["engine"], warmup=True, enable_background_warmup=spec["gate"])
    out["construct_s"] = time.perf_counter() - start
    warmup = server.engine.background_warmup
    async def ask(prompt, request_id):
        t0, first, tokens = time.perf_counter(), None, []
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
        async for o in server.generate(prompt, params, request_id):
            first = first or time.perf_counter()
            tokens = list(o.outputs[0].token_ids)
        return {"ttft_s": first - t0, "latency_s": time.perf_counter() - t0, "tokens": tokens,
                "at_s": t0 - start}
    async def requests():
        return [await ask(p, f"r{i}") for i, p in enumerate(spec["prompts"])]
    out["requests"] = asyncio.run(requests())
    out["first_token_s"] = out["requests"][0]["at_s"] + out["requests"][0]["ttft_s"]
    T["first_token"] = time.time() - (time.perf_counter() - start - out["first_token_s"])
    out["cap_after_requests"] = server.get_stats().get("step_token_cap")
    if warmup is not None:
        warmup.done.wait()  # the whole set compiled (and cached) before the process ends
        out["warmup_done_s"] = time.perf_counter() - start
    stats = server.get_stats()
    out["engine"] = {"fresh": stats["num_compilations"],
                     "cache_hits": stats["num_compilation_cache_hits"],
                     "recompilations": stats["recompilations"]}
    server.shutdown()
else:
    raise SystemExit(f"unknown mode {mode}")
out["cache_dir"] = jax.config.jax_compilation_cache_dir
out["process"] = proc_snapshot()
T["end"] = time.time()
out["times"] = T
print("RESULT " + json.dumps(out), flush=True)
"""
