"""KV cache tiers: what a KV cache layout buys at a fixed memory budget.

One function per workload, each returning a JSON-ready dict and printing its own table;
``--workloads`` picks which run (default: all of WORKLOADS).

    capacity   (a) The KV cache in the model dtype ("auto") against an FP8 KV cache ("fp8",
               float8_e4m3fn), each in an LLM built with the same memory budget (the CPU
               budget, cpu_memory_bytes, with memory_utilization 1.0: weights, the step's
               workspace and the KV pages must fit in it): the KV blocks and tokens the
               engine got (get_stats; max_num_seqs is set high enough that the engine's cap,
               max_num_seqs sequences of max_model_len, is not what limits the pool), then
               the output throughput of one batch of greedy
               requests that needs more KV than the "auto" pool holds, so that "auto" runs
               fewer of them at once (and preempts) while "fp8" runs them all. Both engines
               use the same attention implementation (--attention-backend, default "xla":
               the C++ CPU rows read f32 pages only), so the difference is the pool.

    host_tier  (b) A multi-turn chat whose conversations take about 4x the device pool, each
               turn resending the whole conversation: prefix hit rate and output tokens/s
               with a host KV tier (kv_offloading_size) against without.
    preemption (c) A batch several times the device pool: output tokens/s with
               preemption_mode "recompute", "swap" and "auto" (the same host tier for all
               three), and recompute without a host tier.

(b) and (c) live in bench/_kv_tier_workloads.py (their own timing rules are described there).
(a)'s timing: each engine is built with warmup=False and the batch is run twice; the first run
compiles the step shapes it needs, the prefix cache is reset (LLM.reset_prefix_cache), and the
second, identical run is timed (its compilations are recorded: expect 0). Ratios, not
absolute times, are the result: the machine is shared and noisy (its load average is saved).

    python bench/kv_tiers.py                        # tiny-random-llama, 8 MiB: < 3 min
    python bench/kv_tiers.py --workloads preemption --model bench/.cache/llama-57m \
        --repeats 5 --interleave --output bench/results/kv_tiers_preemption.json
    python bench/kv_tiers.py --budget-mib 16 --num-requests 64 --output /tmp/kv.json

Writes bench/results/kv_tiers.json (--output overrides).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _kv_tier_workloads import host_tier_workload, preemption_workload
from _machine import git_state, loadavg

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "kv_tiers.json"
MIB = 1 << 20


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    return [rng.integers(3, args.vocab, args.prompt_len).tolist() for _ in range(args.num_requests)]


def _capacity_run(args: argparse.Namespace, kv_cache_dtype: str) -> dict:
    """One engine at the budget: its pool, and the timed second run of the batch."""
    from jaxserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_dtype=kv_cache_dtype,
        cpu_memory_bytes=int(args.budget_mib * MIB),
        memory_utilization=1.0,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len or args.prompt_len + args.output_len,
        attention_backend=args.attention_backend,
        warmup=False,
        compilation_cache_dir="",
    )
    build_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompts = _prompts(args)
    llm.generate(prompts, params, use_tqdm=False)  # compiles the shapes the batch needs
    llm.reset_prefix_cache()
    before = llm.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = llm.get_stats()
    num_output = sum(len(o.outputs[0].token_ids) for o in outs)
    blocks = after["num_usable_kv_blocks"]
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "plan_kv_cache_dtype": after["plan"]["kv_cache_dtype"],
        "attention": after["plan"]["attention"],
        "num_kv_blocks": blocks,
        "kv_tokens": blocks * args.block_size,
        "build_s": build_s,
        "elapsed_s": elapsed,
        "output_tokens": num_output,
        "output_tokens_per_s": num_output / elapsed,
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "steps": after["num_steps"] - before["num_steps"],
        "compilations_timed": after["num_compilations"] - before["num_compilations"],
        "peak_kv_slot_utilization": after["peak_kv_slot_utilization"],
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def run_capacity(args: argparse.Namespace) -> dict:
    """Workload (a): "auto" against "fp8" at one memory budget (module docstring)."""
    runs = {kv: _capacity_run(args, kv) for kv in ("auto", "fp8")}
    auto, fp8 = runs["auto"], runs["fp8"]
    pairs = list(zip(auto.pop("token_ids"), fp8.pop("token_ids"), strict=True))
    same = sum(a == b for a, b in pairs)
    # Greedy tokens until the first difference: random-weight models have near-flat logits,
    # where the FP8 rounding of K / V can flip a near-tie (tests/engine/test_fp8_kv_parity.py).
    agree = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for a, b in pairs
    ]
    result = {
        "settings": {
            name: getattr(args, name)
            for name in (
                "model",
                "dtype",
                "budget_mib",
                "block_size",
                "num_requests",
                "prompt_len",
                "output_len",
                "max_num_batched_tokens",
                "max_num_seqs",
                "max_model_len",
                "attention_backend",
            )
        },
        "runs": runs,
        "fp8_over_auto": {
            "kv_tokens": fp8["kv_tokens"] / auto["kv_tokens"],
            "output_tokens_per_s": fp8["output_tokens_per_s"] / auto["output_tokens_per_s"],
        },
        "requests_with_identical_greedy_tokens": same,
        "mean_greedy_tokens_before_first_difference": float(np.mean(agree)),
    }
    _print_capacity(result)
    return result


def _print_capacity(result: dict) -> None:
    s = result["settings"]
    print(
        f"(a) KV capacity at {s['budget_mib']} MiB ({s['model']}, {s['dtype']}, attention "
        f"{s['attention_backend']}): {s['num_requests']} requests x ({s['prompt_len']} prompt + "
        f"{s['output_len']} output) tokens"
    )
    head = (
        f"{'kv_cache_dtype':>14} {'pages':>14} {'blocks':>7} {'tokens':>7} {'out tok/s':>10} "
        f"{'steps':>6} {'preempt':>8} {'compiles':>9}"
    )
    print(head)
    print("-" * len(head))
    for name, r in result["runs"].items():
        print(
            f"{name:>14} {r['plan_kv_cache_dtype']:>14} {r['num_kv_blocks']:>7} "
            f"{r['kv_tokens']:>7} {r['output_tokens_per_s']:>10.1f} {r['steps']:>6} "
            f"{r['preemptions']:>8} {r['compilations_timed']:>9}"
        )
    ratio, same = result["fp8_over_auto"], result["requests_with_identical_greedy_tokens"]
    agree = result["mean_greedy_tokens_before_first_difference"]
    print(
        f"fp8 / auto: {ratio['kv_tokens']:.2f}x KV tokens, {ratio['output_tokens_per_s']:.2f}x "
        f"output tokens/s; identical greedy tokens in {same}/{s['num_requests']} requests, "
        f"{agree:.1f} tokens before the first difference on average"
    )


def _workload_kwargs(args: argparse.Namespace) -> dict:
    """The command line's settings that (b) and (c) share."""
    return dict(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        warmup=not args.no_warmup,
        repeats=args.repeats,
        interleave=args.interleave,
        seed=args.seed,
    )


def run_host_tier(args: argparse.Namespace) -> dict:
    """(b) A multi-turn chat whose conversations take ~4x the device pool: the host tier against
    none (bench/_kv_tier_workloads.py)."""
    result = host_tier_workload(**_workload_kwargs(args))
    w, wo = result["with"], result["without"]
    print(
        f"(b) host tier on a multi-turn chat ({result['settings']['num_conversations']} "
        f"conversations x {result['settings']['num_turns']} turns, ~4x the device pool)"
    )
    print(f"{'':>8} {'prefix hit rate':>16} {'out tok/s':>10}")
    for name, r in (("without", wo), ("with", w)):
        print(f"{name:>8} {r['prefix_hit_rate']:>16.2f} {r['output_tokens_per_s']:>10.1f}")
    print(f"with / without: {result['speedup']:.2f}x; same outputs: {result['same_outputs']}")
    return result


def run_preemption(args: argparse.Namespace) -> dict:
    """(c) A batch several times the device pool: swap, recompute and auto preemption
    (bench/_kv_tier_workloads.py)."""
    result = preemption_workload(
        **_workload_kwargs(args),
        num_requests=args.preemption_requests,
        prompt_tokens=args.preemption_prompt_len,
        output_tokens=args.preemption_output_len,
    )
    print("(c) preemption modes on a batch ~3x the device pool")
    # Per run: its preemptions, how many of them swapped (auto: its choices), and its steps.
    print(
        f"{'mode':>28} {'out tok/s':>10} {'all runs':>24} {'preempt':>8} {'swapped':>8} "
        f"{'steps':>6}"
    )
    for name in ("recompute", "swap", "auto", "recompute_without_host_tier"):
        r = result[name]
        runs = " ".join(f"{x:.0f}" for x in r["all_output_tokens_per_s"])
        print(
            f"{name:>28} {r['output_tokens_per_s']:>10.1f} {runs:>24} {r['num_preemptions']:>8} "
            f"{r['num_swap_preemptions']:>8} {r['num_steps']:>6}"
        )
    if "auto_vs_best_fixed" in result:
        print(f"auto / the better fixed mode: {result['auto_vs_best_fixed']:.3f}")
    print(f"same outputs: {result['same_outputs']}")
    return result


# Workload name -> function(args) -> JSON-ready dict.
WORKLOADS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "capacity": run_capacity,
    "host_tier": run_host_tier,
    "preemption": run_preemption,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, from {sorted(WORKLOADS)} (default: all)",
    )
    p.add_argument("--model", default="tiny-random-llama")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=16)
    a = p.add_argument_group("(a) capacity")
    a.add_argument("--vocab", type=int, default=256, help="prompt ids are drawn below it")
    a.add_argument(
        "--budget-mib", type=float, default=8.0, help="the engine's memory budget (weights + KV)"
    )
    a.add_argument("--num-requests", type=int, default=32)
    a.add_argument("--prompt-len", type=int, default=96)
    a.add_argument("--output-len", type=int, default=64)
    a.add_argument("--max-num-batched-tokens", type=int, default=256)
    a.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="above --num-requests: the pool is capped at max_num_seqs x max_model_len tokens, "
        "and the cap must not be what limits it",
    )
    a.add_argument("--max-model-len", type=int, help="default: prompt + output length")
    a.add_argument("--attention-backend", default="xla")
    # Short prompts and long outputs: every request is admitted, and the batch outgrows the
    # pool while decoding (19 preemptions a run at the defaults; with 256-token prompts and 64
    # output tokens the scheduler admits fewer at once and preempts 3 times, too few to tell
    # the modes apart).
    c = p.add_argument_group("(c) preemption (the device pool holds a third of the batch's KV)")
    c.add_argument("--preemption-requests", type=int, default=16)
    c.add_argument("--preemption-prompt-len", type=int, default=32)
    c.add_argument("--preemption-output-len", type=int, default=256)
    p.add_argument(
        "--repeats", type=int, default=3, help="(b), (c): runs per engine, the fastest reported"
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="(b), (c): build every engine first, run each repeat on all of them in turn",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="(b), (c): compile by an untimed run instead of the engine's warm-up",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown or not names:
        p.error(f"--workloads: unknown {unknown}; choose from {sorted(WORKLOADS)}")
    args.workloads = names
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report: dict = {"loadavg_before": loadavg(), "git": git_state(), "workloads": {}}
    for name in args.workloads:
        report["workloads"][name] = WORKLOADS[name](args)
    report["loadavg_after"] = loadavg()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.output}")
    return report


if __name__ == "__main__":
    main()
