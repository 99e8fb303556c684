"""bench/gpu_e2e.py's jaxserve phases, each in a child process: cold (build, warm up bucket by
bucket, then the offline throughput run) and warm (the same start served by the persistent
compilation cache, then a short generate).
"""

from __future__ import annotations

import dataclasses
import time

import _datasets
import numpy as np
from _gpu_e2e_child_io import Result, spec_requests
from _metrics import ModelShape, RequestTiming, utilization


def _start_jax(compile_cache: str) -> None:
    """Apply the CPU workaround (before jax starts its backends) and point jax's persistent
    compilation cache at ``compile_cache``, caching every compilation."""
    from jaxserve.runner.xla_flags import apply_cpu_workarounds

    apply_cpu_workarounds()
    import jax

    jax.config.update("jax_compilation_cache_dir", compile_cache)
    for name, value in (
        ("jax_persistent_cache_min_compile_time_secs", 0.0),
        ("jax_persistent_cache_min_entry_size_bytes", 0),
    ):
        try:
            jax.config.update(name, value)
        except (AttributeError, KeyError, ValueError):  # a jax without that option
            pass


class _CacheHits:
    """Compilations loaded from the persistent cache in this process (jax monitoring events)."""

    def __init__(self) -> None:
        import jax

        self.count = 0
        jax.monitoring.register_event_listener(self._on_event)

    def _on_event(self, event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.count += 1


def _device_info() -> dict:
    import jax

    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    return dict(
        jax_version=jax.__version__,
        platform=dev.platform,
        device_kind=dev.device_kind,
        bytes_limit=stats.get("bytes_limit"),
        peak_bytes_in_use=stats.get("peak_bytes_in_use"),
    )


def _build_and_warm(spec: dict, res: Result, *, stop_for_run_s: float | None) -> object:
    """LLM(...) without warm-up, then the runner's warmup one bucket at a time (each timed).
    With stop_for_run_s, warming stops when less than that is left before the deadline (the
    rest compiles during the run, which says so)."""
    t_spawn, deadline = spec["t_spawn"], spec["deadline"]
    res["started_after_spawn_s"] = time.time() - t_spawn
    t0 = time.perf_counter()
    _start_jax(spec["compile_cache"])
    hits = _CacheHits()
    from jaxserve import LLM

    res["import_s"] = time.perf_counter() - t0
    res["status"] = "constructing"
    res.save()
    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], warmup=False, **spec["engine"])
    res["construct_s"] = time.perf_counter() - t0
    res["construct_compilations"] = llm.engine.runner.num_compilations
    res["device"] = _device_info()
    res["status"] = "warming up"
    res.save()
    runner = llm.engine.runner
    shapes = list(runner.buckets.all_shapes())
    res["num_buckets"] = len(shapes)
    res["buckets"] = []
    t_warm = time.perf_counter()
    for shape in shapes:
        left = deadline - time.time()
        if stop_for_run_s is not None and left < stop_for_run_s:
            res["warmup_stopped"] = f"{left:.0f} s left before the deadline: kept for the run"
            break
        t = time.perf_counter()
        before, before_hits = runner.num_compilations, runner.num_compilation_cache_hits
        runner.warmup([shape])
        res["buckets"].append(
            dict(
                tokens=shape[0],
                rows=shape[1],
                width=shape[2],
                seconds=time.perf_counter() - t,
                compilations=runner.num_compilations - before,  # fresh ones, as the engine counts
                # loaded, not compiled: from the executable store or jax's persistent cache, as
                # the engine counts (jax's cache events alone missed the store: the first H100
                # run's warm start said 0 where the engine counted 33)
                cache_hits=runner.num_compilation_cache_hits - before_hits,
            )
        )
        res.save()
    res["warmup_s"] = time.perf_counter() - t_warm
    res["warmup_complete"] = len(res["buckets"]) == len(shapes)
    res["warmup_compilations"] = sum(b["compilations"] for b in res["buckets"])
    res["warmup_cache_hits"] = sum(b["cache_hits"] for b in res["buckets"])
    res["start_s"] = res["construct_s"] + res["warmup_s"]  # construct + warmup
    res["ready_after_spawn_s"] = time.time() - t_spawn  # process start, imports included
    res["cache_hits_total"] = hits.count  # jax's persistent cache events in the process
    res["status"] = "ready"
    res.save()
    return llm


def _params(r: _datasets.BenchRequest, seed: int, max_tokens: int | None = None):
    from jaxserve import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens or r.output_len, temperature=1.0, ignore_eos=True, seed=seed
    )


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    v = np.asarray(values) * 1e3
    return {f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}


def _step_until_done(
    engine, ids: list[str], deadline: float, res: Result, before: int
) -> tuple[dict[str, int], dict[str, float], bool, float]:
    """Step the engine until its requests (`ids`) finish or `deadline` (time.time()) is 3 s
    away, saving progress in `res` every 5 s (compilations counted from `before`).

    Returns:
        (output tokens per request id, finish time (s from the first step) per finished id,
        whether the run was cut at the deadline, seconds elapsed).
    """
    runner = engine.runner
    generated = dict.fromkeys(ids, 0)
    finish: dict[str, float] = {}
    truncated = False
    t0 = last_save = time.perf_counter()
    while engine.has_unfinished_requests():
        # finished_only: what LLM.generate reads (no RequestOutput per running request).
        for out in engine.step(finished_only=True):
            generated[out.request_id] = len(out.outputs[0].token_ids)
            finish[out.request_id] = time.perf_counter() - t0
        if time.perf_counter() - last_save > 5:  # progress, in case the process is killed
            last_save = time.perf_counter()
            res["run_progress"] = dict(
                seconds=last_save - t0,
                num_finished=len(finish),
                num_output_tokens_of_finished=sum(generated.values()),
                compilations=runner.num_compilations - before,
            )
            res.save()
        if time.time() > deadline - 3 and engine.has_unfinished_requests():
            # Out of time: one more step reports every running request's tokens so far.
            for out in engine.step():
                generated[out.request_id] = len(out.outputs[0].token_ids)
            truncated = True
            break
    return generated, finish, truncated, time.perf_counter() - t0


def child_cold(spec: dict, res: Result) -> None:
    """Cold start, then the offline throughput run (see the module docstring)."""
    llm = _build_and_warm(spec, res, stop_for_run_s=spec["run_reserve_s"])
    engine, runner = llm.engine, llm.engine.runner
    requests = spec_requests(spec)
    # Untimed: a few short requests touch every host path once (the baseline gets one too);
    # not when compiling left no time for it.
    small = requests[: spec["warmup_requests"]] if res["warmup_complete"] else []
    before = runner.num_compilations
    t0 = time.perf_counter()
    if small:
        llm.generate(
            [r.prompt_token_ids for r in small],
            [_params(r, i, min(r.output_len, 8)) for i, r in enumerate(small)],
            use_tqdm=False,
        )
    res["warmup_run_s"] = time.perf_counter() - t0
    res["warmup_run_compilations"] = runner.num_compilations - before
    res["status"] = "running"
    res.save()

    before = runner.num_compilations
    ids = [f"bench-{i}" for i in range(len(requests))]
    for rid, (i, r) in zip(ids, enumerate(requests), strict=True):
        engine.add_request(rid, r.prompt_token_ids, _params(r, spec["seed"] + i))
    generated, finish, truncated, elapsed = _step_until_done(
        engine, ids, spec["deadline"], res, before
    )
    stats = llm.get_stats()
    num_out = sum(generated.values())
    num_in = sum(r.prompt_len for r in requests)
    run = dict(
        num_requests=len(requests),
        num_finished=len(finish),
        complete=not truncated,
        elapsed_s=elapsed,
        num_prompt_tokens=num_in,
        num_output_tokens=num_out,
        num_output_tokens_requested=sum(r.output_len for r in requests),
        output_tokens_per_s=num_out / elapsed,
        total_tokens_per_s=(num_in + num_out) / elapsed if not truncated else None,
        requests_per_s=len(finish) / elapsed,
        e2e_latency_ms=_percentiles(list(finish.values())),
        compilations_during_run=runner.num_compilations - before,
        mode="offline, every request at t=0, engine.step(finished_only=True)",
    )
    if not truncated:
        shape = ModelShape.from_hf_config(spec["model_config"])
        shape = dataclasses.replace(shape, bytes_per_param=2)
        timings = [RequestTiming(r.prompt_len, r.output_len) for r in requests]
        run.update(utilization(shape, timings, elapsed, stats.get("num_steps"), {}))
    res["run"] = run
    res["stats"] = stats
    res["device"] = _device_info()
    res["status"] = "done" if not truncated else "run cut at the deadline"
    res.save()


def child_warm(spec: dict, res: Result) -> None:
    """Warm start from the persistent compilation cache, then a short generate."""
    llm = _build_and_warm(spec, res, stop_for_run_s=None)
    requests = spec_requests(spec)[: spec["check_requests"]]
    before = llm.engine.runner.num_compilations
    t0 = time.perf_counter()
    outs = llm.generate(
        [r.prompt_token_ids for r in requests],
        [_params(r, i, min(r.output_len, 16)) for i, r in enumerate(requests)],
        use_tqdm=False,
    )
    res["check_generate"] = dict(
        num_requests=len(requests),
        num_output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
        seconds=time.perf_counter() - t0,
        compilations=llm.engine.runner.num_compilations - before,
    )
    res["stats"] = llm.get_stats()
    res["status"] = "done"
    res.save()
