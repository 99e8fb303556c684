"""Async scheduling against synchronous steps, side by side in one run (issue 34).

For each model (the demo model and the 57M benchmark model of bench/throughput.py) one engine is
built and warmed up; then, for each batch size, the same greedy decode workload (``batch``
requests of ``--prompt-len`` tokens, ``--max-tokens`` outputs each, ignore_eos) runs with async
scheduling on (always running ahead), off, and under the CPU plan's measured policy
(engine/run_ahead.py: one RunAheadPolicy per engine, kept across its runs as a server's would
be, after one untimed run per batch to learn it), in the order on, off, policy, policy, off,
on (a linear drift of the machine's load cancels in the means), untraced for throughput, then
once more on and off traced (StepTrace) for the device's idle time between steps. Reported
per (model, batch):

    tok/s on, off, ratio   output tokens per second of the untraced runs (mean of two)
    policy, ratio          the same under the measured policy, and policy / off
    idle on, off           the device's idle time between steps, as a share of the decode
                           steps' wall time (traced runs: StepTrace.device_idle_s over the sum
                           of device and idle time), and on / off
    host ms                the host's time per step (schedule + dispatch + collect + update)
    same                   greedy tokens identical with and without (every run)

    python bench/async_scheduling.py                 # both models, batches 1,16,64,256
    python bench/async_scheduling.py --models demo --batches 1,16 --max-tokens 16

Writes bench/results/async_scheduling.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import loadavg, write_results  # noqa: E402
from throughput import PRESETS, enable_compile_cache, ensure_checkpoint  # noqa: E402

from jaxserve.runner.xla_flags import apply_cpu_workarounds  # noqa: E402

RESULTS = HERE / "results"
ORDER = ("on", "off", "policy", "policy", "off", "on")  # ABCCBA


def build(model: str, max_batch: int, max_len: int, budget: int, warmup: bool = True):
    from jaxserve import LLMEngine

    blocks = max_batch * (-(-max_len // 16)) + 1
    return LLMEngine(model=model, dtype="float32", block_size=16, num_kv_blocks=blocks,
                     max_num_seqs=max_batch, max_num_batched_tokens=max(budget, max_batch),
                     max_model_len=max_len, enable_prefix_caching=False, seed=0,
                     warmup=warmup)  # fmt: skip


def workload(engine, batch: int, prompt_len: int, max_tokens: int, mode: str, traced: bool):
    """One run in ``mode`` (on, off, policy): (seconds, output tokens, token lists, traces)."""
    from jaxserve import SamplingParams
    from jaxserve.engine.run_ahead import RunAheadPolicy

    core = engine.core
    if not hasattr(core, "bench_policy"):  # the engine's own policy, or one of ours
        core.bench_policy = core.run_ahead_policy or RunAheadPolicy()
    core.reset_scheduler(async_scheduling=mode != "off")
    core.run_ahead_policy = core.bench_policy if mode == "policy" else None
    traces: list = []
    if traced:
        engine.set_step_tracer(traces.append)
    rng = np.random.default_rng(batch)
    vocab = engine.core.runner.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), rng.integers(3, vocab, prompt_len).tolist(), params)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    for _ in range(100_000):  # bounded: far more steps than the workload needs
        if not engine.has_unfinished_requests():
            break
        for out in engine.step(finished_only=True):
            tokens[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    engine.set_step_tracer(None)
    return seconds, batch * max_tokens, [tokens[str(i)] for i in range(batch)], traces


def idle_share(traces: list) -> tuple[float, float]:
    """(device idle share of the decode steps' device + idle time, host ms per step)."""
    decode = [t for t in traces if t.num_rows and t.num_tokens == t.num_rows][1:]
    if not decode:
        return float("nan"), float("nan")
    idle = sum(t.device_idle_s for t in decode)
    busy = sum(t.device_s for t in decode)
    return idle / (idle + busy), 1e3 * float(np.mean([t.total_s for t in decode]))


def measure(engine, batch: int, args) -> dict:
    runs: dict[str, list[float]] = {"on": [], "off": [], "policy": []}
    outputs: dict[str, list] = {}
    if args.lazy_warmup:  # untimed runs compile what the timed ones meet
        for mode in ("on", "off"):
            workload(engine, batch, args.prompt_len, args.max_tokens, mode, False)
    stats = engine.get_stats()
    compiled = stats["num_compilations"] + stats["num_compilation_cache_hits"]
    outputs["policy"] = workload(engine, batch, args.prompt_len, args.max_tokens, "policy",
                                 False)[2]  # fmt: skip
    for mode in ORDER:
        s, n, toks, _ = workload(engine, batch, args.prompt_len, args.max_tokens, mode, False)
        runs[mode].append(n / s)
        outputs.setdefault(mode, toks)
        assert outputs[mode] == toks, "a rerun changed greedy tokens"
    traced = {}
    for on in (True, False):
        mode = "on" if on else "off"
        _, _, toks, traces = workload(engine, batch, args.prompt_len, args.max_tokens, mode, True)
        traced[on] = idle_share(traces)
        assert outputs[mode] == toks, "tracing changed greedy tokens"
    on_tps, off_tps = float(np.mean(runs["on"])), float(np.mean(runs["off"]))
    policy_tps = float(np.mean(runs["policy"]))
    return dict(
        batch=batch,
        tok_s_on=on_tps,
        tok_s_off=off_tps,
        ratio=on_tps / off_tps,
        tok_s_policy=policy_tps,
        policy_ratio=policy_tps / off_tps,
        policy_stats=engine.core.bench_policy.stats(),
        tok_s_runs=runs,
        idle_on=traced[True][0],
        idle_off=traced[False][0],
        idle_ratio=traced[True][0] / traced[False][0] if traced[False][0] else float("nan"),
        host_ms_on=traced[True][1],
        host_ms_off=traced[False][1],
        same_tokens=outputs["on"] == outputs["off"] == outputs["policy"],
        # compilations in the policy's learning run and the timed ones (0 expected)
        compiled_after_warmup=sum(
            engine.get_stats()[k] for k in ("num_compilations", "num_compilation_cache_hits")
        )
        - compiled,  # fmt: skip
        loadavg=loadavg(),
    )


def model_path(name: str, cache: Path) -> str:
    if name == "demo":
        return "tiny-random-llama"
    return str(ensure_checkpoint(PRESETS["default"], cache))


def print_table(results: list[dict]) -> None:
    head = (f"{'model':6s} {'batch':>5s} {'tok/s on':>9s} {'tok/s off':>9s} {'on/off':>6s} "
            f"{'policy':>9s} {'pol/off':>7s} "
            f"{'idle on':>8s} {'idle off':>8s} {'on/off':>7s} {'host ms on':>10s} "
            f"{'host ms off':>11s} same")  # fmt: skip
    print(head)
    for r in results:
        print(f"{r['model']:6s} {r['batch']:5d} {r['tok_s_on']:9.1f} {r['tok_s_off']:9.1f} "
              f"{r['ratio']:6.3f} {r['tok_s_policy']:9.1f} {r['policy_ratio']:7.3f} "
              f"{r['idle_on']:8.1%} {r['idle_off']:8.1%} "
              f"{r['idle_ratio']:7.3f} {r['host_ms_on']:10.2f} {r['host_ms_off']:11.2f} "
              f"{'yes' if r['same_tokens'] else 'NO'}")  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    apply_cpu_workarounds()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="demo,57m", help="comma list of demo, 57m")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--cache", default=str(HERE / ".cache"))
    p.add_argument("--lazy-warmup", action="store_true",
                   help="no warm-up: untimed runs in each mode compile what the timed runs meet "
                   "(faster on a loaded machine; the timed runs then compile nothing)")  # fmt: skip
    p.add_argument("--output", default=str(RESULTS / "async_scheduling.json"))
    args = p.parse_args(argv)
    enable_compile_cache(Path(args.cache) / "jax")
    batches = [int(b) for b in args.batches.split(",")]
    load = loadavg()
    results = []
    for name in args.models.split(","):
        print(f"{name}: building and warming up ...", flush=True)
        engine = build(model_path(name, Path(args.cache)), max(batches),
                       args.prompt_len + args.max_tokens, args.max_num_batched_tokens,
                       not args.lazy_warmup)  # fmt: skip
        for batch in batches:
            results.append(dict(model=name, **measure(engine, batch, args)))
            print_table(results[-1:])
        del engine
    print()
    print_table(results)
    write_results(args.output, results, args, load)
    return results


if __name__ == "__main__":
    main()
