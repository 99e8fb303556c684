"""jaxserve under bench/throughput.py: one warmed-up LLMEngine, driven step by step.

The engine is built (and its runner warmed up) once; every timed run then gets a fresh
Scheduler, which owns the block pool and the prefix cache, so runs never see each other's
cached blocks, their counters start at zero, and prefix caching can be switched off without
recompiling anything: the runner and its compiled steps are shared by all runs. Three ways of
feeding requests, all through LLMEngine.add_request / step:

    offline     every request submitted at t = 0 (`vllm bench throughput`)
    poisson     request i submitted at its Poisson arrival time (--request-rate)
    static      the pre-vLLM way, on the same model and the same jitted step: a batch of B
                requests is admitted only when the whole previous batch has finished; every
                prompt is left-padded to the batch's longest, and every request generates the
                batch's longest output (max_tokens padded), so the wasted slots cost what they
                cost a static batcher. Prefix caching is off (it would make the padding free).

Each request's first token and last useful token are timed from the step that returned them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from _datasets import BenchRequest
from _metrics import RequestTiming, RunResult

PAD_ID = 0


@dataclass
class EngineSettings:
    """What every engine of one benchmark run is configured with (vLLM gets the same)."""

    model: str
    block_size: int = 32
    num_kv_blocks: int = 4096  # usable blocks (jaxserve adds its null block)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    seed: int = 0


def build_engine(settings: EngineSettings):
    """LLMEngine with every bucket compiled. Returns (engine, warm-up seconds, compilations)."""
    from jaxserve import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(
        model=settings.model,
        dtype="float32",
        block_size=settings.block_size,
        num_kv_blocks=settings.num_kv_blocks + 1,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        enable_prefix_caching=True,
        warmup=True,
        seed=settings.seed,
    )
    return engine, time.perf_counter() - t0, compiles(engine)


def reset_scheduler(
    engine, enable_prefix_caching: bool, async_scheduling: bool | None = None
) -> None:
    """Give the engine a fresh Scheduler (empty pool and prefix cache, zeroed counters), with
    async scheduling switched when given (None: as it is)."""
    engine.core.reset_scheduler(
        enable_prefix_caching=enable_prefix_caching, async_scheduling=async_scheduling
    )


@dataclass
class _Submission:
    request_id: str
    prompt: list[int]
    max_tokens: int  # what the engine is asked for (static batching: padded)
    timing: RequestTiming  # counts only the useful prompt / output tokens


# An admission policy: given the queue of not-yet-submitted requests, the engine and the time
# since start, pop and return those to submit now.
Admit = Callable[[deque, object, float], list[_Submission]]


def _admit_all(pending: deque, engine, now: float) -> list[_Submission]:
    out = list(pending)
    pending.clear()
    return out


def _admit_arrived(pending: deque, engine, now: float) -> list[_Submission]:
    out = []
    while pending and pending[0].timing.arrival <= now:
        out.append(pending.popleft())
    return out


def _admit_static(batch_size: int) -> Admit:
    def admit(pending: deque, engine, now: float) -> list[_Submission]:
        if engine.has_unfinished_requests():
            return []  # no admission until the whole batch has finished
        return [pending.popleft() for _ in range(min(batch_size, len(pending)))]

    return admit


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Arrival offsets (s) of a Poisson process of `rate` requests/s; all 0 if rate is inf."""
    if not np.isfinite(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps) - gaps[0]


def _submissions(
    requests: list[BenchRequest], tag: str, arrivals: np.ndarray, static_batch: int | None
) -> list[_Submission]:
    subs = []
    for i, req in enumerate(requests):
        prompt, max_tokens = req.prompt_token_ids, req.output_len
        if static_batch:
            batch = requests[i - i % static_batch : i - i % static_batch + static_batch]
            longest = max(r.prompt_len for r in batch)
            prompt = [PAD_ID] * (longest - req.prompt_len) + prompt
            max_tokens = max(r.output_len for r in batch)
        timing = RequestTiming(req.prompt_len, req.output_len, arrival=float(arrivals[i]))
        subs.append(_Submission(f"{tag}-{i}", prompt, max_tokens, timing))
    return subs


def _record_outputs(outs, by_id: dict, now: float) -> int:
    """Stamp each output's request timing (first token, last useful token, finish) at `now`;
    returns the tokens of the requests that finished."""
    num_generated = 0
    for out in outs:
        t = by_id[out.request_id].timing
        n = len(out.outputs[0].token_ids)
        if n and not np.isfinite(t.first_token):
            t.first_token = now
        if n >= t.output_len and not np.isfinite(t.last_useful_token):
            t.last_useful_token = now
        if out.finished:
            t.finish = now
            num_generated += n
    return num_generated


def _engine_stats(engine, compiles_before: int) -> dict:
    """The engine's counters after a run: steps, preemptions, peak KV use, prefix cache hits,
    and the compilations since `compiles_before`."""
    stats = engine.get_stats()
    queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
    return {
        "num_steps": stats["num_steps"],
        "num_preemptions": stats["num_preemptions"],
        "peak_kv_slot_utilization": stats["peak_kv_slot_utilization"],
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "compilations_during_run": compiles(engine) - compiles_before,
    }


def run(
    engine,
    requests: list[BenchRequest],
    *,
    name: str,
    mode: str = "offline",
    enable_prefix_caching: bool = True,
    temperature: float = 1.0,
    request_rate: float = float("inf"),
    static_batch_size: int = 16,
    seed: int = 0,
    async_scheduling: bool | None = None,
) -> RunResult:
    """One timed run of `requests` on a fresh scheduler; mode: offline | poisson | static."""
    from jaxserve import SamplingParams

    if mode == "static":
        enable_prefix_caching = False
    reset_scheduler(engine, enable_prefix_caching, async_scheduling)
    arrivals = poisson_arrivals(len(requests), request_rate if mode == "poisson" else np.inf, seed)
    subs = _submissions(requests, name, arrivals, static_batch_size if mode == "static" else None)
    admit = {"offline": _admit_all, "poisson": _admit_arrived}.get(mode)
    admit = admit or _admit_static(static_batch_size)
    by_id = {s.request_id: s for s in subs}
    pending = deque(subs)
    compiles_before = compiles(engine)
    num_generated = 0

    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        for s in admit(pending, engine, now):
            params = SamplingParams(
                max_tokens=s.max_tokens,
                temperature=temperature,
                ignore_eos=True,
                seed=seed + int(s.request_id.rsplit("-", 1)[1]),
            )
            engine.add_request(s.request_id, s.prompt, params)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].timing.arrival - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        num_generated += _record_outputs(outs, by_id, time.perf_counter() - t0)
    elapsed = time.perf_counter() - t0

    extra = {
        "mode": mode,
        "enable_prefix_caching": enable_prefix_caching,
        "async_scheduling": engine.core.async_scheduling,
        "num_generated_tokens": num_generated,  # static batching: padded outputs included
        **_engine_stats(engine, compiles_before),
    }
    if mode == "poisson":
        extra["request_rate"] = request_rate
    if mode == "static":
        extra["static_batch_size"] = static_batch_size
    return RunResult(name, elapsed, [s.timing for s in subs], extra)


def warm_up_run(engine, requests: list[BenchRequest], num: int = 4) -> int:
    """A short untimed run (a few requests, few tokens) to touch every host path once, as the
    baselines get; returns the compilations it caused."""
    small = [BenchRequest(r.prompt_token_ids, min(r.output_len, 8)) for r in requests[:num]]
    before = compiles(engine)
    run(engine, small, name="warmup")
    return compiles(engine) - before


def compiles(engine) -> int:
    """Step compilations so far, fresh or loaded from the persistent compilation cache (the
    benchmark's own cache makes later runs load them): either means a shape was new."""
    return engine.runner.num_compilations + engine.runner.num_compilation_cache_hits
