"""The step's two jitted halves against one fused program (runner/fused_step.py), side by side in
one process.

For each model, two engines are built (JAXSERVE_FUSED_STEP=1, then 0; warmup=False, so each
compiles only what the runs meet, in an untimed first round) and run alternately, in the order
fused, split, split, fused per round (a linear drift of the machine's load cancels):

    (medians, and the ratio of the best rounds: on a loaded machine a round is only ever
    slowed down)

    step ms     the runner alone: ``--steps`` calls of ModelRunner.run_prepared on a decode
                batch of R rows (PreparedBatch.null_block: R - 1 decodes and a short chunk),
                then a wait for the last one; the median round's time per step
    tok/s       the engine: R greedy requests of ``--prompt-len`` tokens and ``--max-tokens``
                outputs each (ignore_eos), async scheduling as the plan decides; median round
    same        greedy tokens identical fused and split (every round)

    python bench/fused_step.py                          # demo model, rows 16 and 64
    python bench/fused_step.py --models demo,57m --rows 1,16,64,256

Writes bench/results/fused_step.json.
"""

from __future__ import annotations

import argparse
import os
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
MODES = ("fused", "split")
ORDER = ("fused", "split", "split", "fused")


def build(model: str, fused: bool, max_rows: int, max_len: int):
    from jaxserve import LLMEngine

    os.environ["JAXSERVE_FUSED_STEP"] = "1" if fused else "0"
    try:
        blocks = max_rows * (-(-max_len // 16)) + 1
        engine = LLMEngine(model=model, dtype="float32", block_size=16, num_kv_blocks=blocks,
                           max_num_seqs=max_rows, max_num_batched_tokens=max(256, max_rows),
                           max_model_len=max_len, enable_prefix_caching=False, seed=0,
                           warmup=False)  # fmt: skip
    finally:
        del os.environ["JAXSERVE_FUSED_STEP"]
    assert engine.get_stats()["plan"]["fused_step"] == fused
    return engine


def step_seconds(engine, rows: int, steps: int) -> float:
    """Seconds per run_prepared call on a decode batch of ``rows`` rows."""
    import jax

    from jaxserve.runner.input_batch import PreparedBatch
    from jaxserve.runner.sampling_metadata import SamplingMetadata

    runner = engine.runner
    t = runner.buckets.padded_tokens(rows)
    r = runner.buckets.padded_rows(t)
    batch = PreparedBatch.null_block(t, r, runner.buckets.padded_width(2), runner.block_size)
    md = SamplingMetadata.neutral(r, runner.vocab_size)
    start = time.perf_counter()
    for _ in range(steps):
        out, _, _ = runner.run_prepared(batch, md)
    jax.block_until_ready(out.token_ids)
    return (time.perf_counter() - start) / steps


def workload(engine, rows: int, prompt_len: int, max_tokens: int):
    """(output tok/s, token lists) of one greedy decode run."""
    from jaxserve import SamplingParams

    rng = np.random.default_rng(rows)
    vocab = engine.runner.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(rows):
        engine.add_request(str(i), rng.integers(3, vocab, prompt_len).tolist(), params)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    for _ in range(100_000):  # bounded: far more steps than the workload needs
        if not engine.has_unfinished_requests():
            break
        for out in engine.step(finished_only=True):
            tokens[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    return rows * max_tokens / seconds, [tokens[str(i)] for i in range(rows)]


def measure(engines: dict, rows: int, args) -> dict:
    steps = {m: [] for m in MODES}
    tok_s = {m: [] for m in MODES}
    tokens = {m: workload(engines[m], rows, args.prompt_len, args.max_tokens)[1] for m in MODES}
    for m in MODES:  # compile what the timed rounds meet
        step_seconds(engines[m], rows, 2)
    compiled = {m: engines[m].get_stats()["num_compilations"] for m in MODES}
    for _ in range(args.rounds):
        for m in ORDER:
            steps[m].append(step_seconds(engines[m], rows, args.steps))
            tps, toks = workload(engines[m], rows, args.prompt_len, args.max_tokens)
            tok_s[m].append(tps)
            assert toks == tokens[m], "a rerun changed greedy tokens"
    after = {m: engines[m].get_stats()["num_compilations"] - compiled[m] for m in MODES}
    ms = {m: 1e3 * float(np.median(steps[m])) for m in MODES}
    tps = {m: float(np.median(tok_s[m])) for m in MODES}
    return dict(
        rows=rows,
        step_ms_fused=ms["fused"],
        step_ms_split=ms["split"],
        step_ratio=ms["split"] / ms["fused"],
        tok_s_fused=tps["fused"],
        tok_s_split=tps["split"],
        tok_s_ratio=tps["fused"] / tps["split"],
        # the fastest round of each: the machine's load only ever slows a round down
        step_ratio_best=min(steps["split"]) / min(steps["fused"]),
        tok_s_ratio_best=max(tok_s["fused"]) / max(tok_s["split"]),
        runs={"step_s": steps, "tok_s": tok_s},
        same_tokens=tokens["fused"] == tokens["split"],
        compiled_after_first_round=after,
        loadavg=loadavg(),
    )


def print_table(results: list[dict]) -> None:
    print(f"{'model':6s} {'rows':>4s} {'step ms fused':>13s} {'split':>7s} {'split/fused':>11s} "
          f"{'best':>6s} {'tok/s fused':>11s} {'split':>8s} {'fused/split':>11s} {'best':>6s} "
          "same")  # fmt: skip
    for r in results:
        print(f"{r['model']:6s} {r['rows']:4d} {r['step_ms_fused']:13.3f} "
              f"{r['step_ms_split']:7.3f} {r['step_ratio']:11.3f} {r['step_ratio_best']:6.3f} "
              f"{r['tok_s_fused']:11.1f} {r['tok_s_split']:8.1f} {r['tok_s_ratio']:11.3f} "
              f"{r['tok_s_ratio_best']:6.3f} {'yes' if r['same_tokens'] else 'NO'}")  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    apply_cpu_workarounds()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="demo", help="comma list of demo, 57m")
    p.add_argument("--rows", default="16,64")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--cache", default=str(HERE / ".cache"))
    p.add_argument("--output", default=str(RESULTS / "fused_step.json"))
    args = p.parse_args(argv)
    enable_compile_cache(Path(args.cache) / "jax")
    rows = [int(r) for r in args.rows.split(",")]
    load = loadavg()
    results = []
    for name in args.models.split(","):
        path = "tiny-random-llama" if name == "demo" else str(
            ensure_checkpoint(PRESETS["default"], Path(args.cache)))  # fmt: skip
        print(f"{name}: building ...", flush=True)
        engines = {m: build(path, m == "fused", max(rows), args.prompt_len + args.max_tokens)
                   for m in MODES}  # fmt: skip
        for r in rows:
            results.append(dict(model=name, **measure(engines, r, args)))
            print_table(results[-1:])
        del engines
    print()
    print_table(results)
    write_results(args.output, results, args, load)
    return results


if __name__ == "__main__":
    main()
