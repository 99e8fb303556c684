"""Workloads of bench/kv_tiers.py for the host KV tier and swap preemption, on the public API
only (jaxserve.LLM, SamplingParams, LLM.get_stats()).

    host_tier_workload      (b) multi-turn chat whose conversations together take about
                            ``prefix_to_pool`` times the device pool: each turn resends the
                            whole conversation. Without a host tier a conversation's prefix
                            has been evicted by the time its next turn comes and is recomputed;
                            with one it comes back from host memory. Prefix hit rate and output
                            tokens/s, with the tier against without.
    preemption_workload     (c) a batch whose KV is several times the device pool, so requests
                            are preempted: output tokens/s with preemption_mode "recompute",
                            "swap" and "auto", all three with the same host tier (so that only
                            the preemption mode differs), and recompute without a host tier.

Prompts are random token ids and decoding is greedy with ignore_eos, so every engine generates
the same number of tokens (and, the engine guarantees, the same tokens: each result says
whether they were). Only the generate() calls are timed, after every shape they run is
compiled: by the engine's warm-up (``warmup=True``), or else by an untimed run of the same
shapes on other random prompts first (fewer compilations: only the shapes the workload uses;
a timed run may still meet a new shape, which its "num_compilations" shows). Each engine runs
the workload ``repeats`` times on fresh random prompts; the fastest run is reported (the others'
tokens/s are listed). With ``interleave=True`` every engine is built first and each repeat runs
on all of them in turn, so a machine whose speed drifts (other processes) slows every engine
alike; it holds every engine's memory at once, so the default builds, runs and drops them one
after another.
"""

from __future__ import annotations

import random
import time
from typing import Any

_COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "host_cache_hits",
    "device_to_host_bytes",
    "host_to_device_bytes",
    "num_preemptions",
    "num_swap_preemptions",
    "num_swap_fallbacks",
    "num_steps",
    "num_compilations",  # during a timed run: 0 when every shape was compiled before
)


def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]  # inside every test vocabulary


def _compare(
    model: str,
    settings: dict[str, Any],
    engines: dict[str, dict[str, Any]],
    workloads: list[list[list[list[int]]]],
    warm: list[list[list[int]]],
    params: Any,
    interleave: bool,
) -> dict[str, tuple[dict[str, Any], list]]:
    """Every workload on one engine per entry of ``engines`` (name -> its extra LLM kwargs).

    Returns:
        name -> (the fastest run's figures, with every run's tokens/s under
        "all_output_tokens_per_s"; the histories of every run).
    """
    from jaxserve import LLM

    def build(name: str) -> Any:
        llm = LLM(model, **settings, **engines[name])
        if not settings["warmup"]:
            _run(llm, warm, params)  # compiles the shapes the timed runs use
        return llm

    runs: dict[str, list] = {name: [] for name in engines}
    if interleave:
        llms = {name: build(name) for name in engines}
        for turns in workloads:
            for name, llm in llms.items():
                runs[name].append(_run(llm, turns, params))
        del llms
    else:
        for name in engines:
            llm = build(name)
            runs[name] = [_run(llm, turns, params) for turns in workloads]
            del llm
    out = {}
    for name, results in runs.items():
        best = max(results, key=lambda r: r[0]["output_tokens_per_s"])[0]
        best["all_output_tokens_per_s"] = [r[0]["output_tokens_per_s"] for r in results]
        out[name] = (best, [r[1] for r in results])
    return out


def _run(llm: Any, turns: list[list[list[int]]], params: Any) -> tuple[dict[str, Any], list]:
    """Generate turn after turn: turn t's prompts extend each conversation's history (empty for
    a one-turn workload) with turns[t][i]; the outputs join the history. Returns the run's
    figures (seconds, output tokens and tokens/s, the counters' deltas) and the histories."""
    histories: list[list[int]] = [[] for _ in turns[0]]
    before = llm.get_stats()
    num_out = 0
    start = time.perf_counter()
    for turn in turns:
        prompts = [h + msg for h, msg in zip(histories, turn, strict=True)]
        for i, out in enumerate(llm.generate(prompts, params, use_tqdm=False)):
            ids = list(out.outputs[0].token_ids)
            histories[i] = prompts[i] + ids
            num_out += len(ids)
    seconds = time.perf_counter() - start
    after = llm.get_stats()
    figures: dict[str, Any] = {k: after[k] - before[k] for k in _COUNTERS}
    figures.update(
        seconds=seconds,
        output_tokens=num_out,
        output_tokens_per_s=num_out / seconds,
        prefix_hit_rate=figures["prefix_cache_hits"] / max(figures["prefix_cache_queries"], 1),
        num_host_kv_blocks=after["num_host_kv_blocks"],
    )
    return figures, histories


def _chat(rng: random.Random, num_conversations: int, lengths: tuple[int, ...]) -> list:
    """One multi-turn chat: per turn (of ``lengths[i]`` new tokens each), every conversation's
    new ids, drawn turn by turn, conversation by conversation."""
    return [[_random_ids(rng, n) for _ in range(num_conversations)] for n in lengths]


def _engine_settings(
    block_size: int, num_kv_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
    max_model_len: int, dtype: str, warmup: bool,
) -> dict[str, Any]:  # fmt: skip
    """The LLM arguments every engine of a workload shares (``num_kv_blocks`` usable blocks,
    plus the null block)."""
    return dict(
        block_size=block_size,
        num_kv_blocks=num_kv_blocks + 1,  # + the null block
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        dtype=dtype,
        warmup=warmup,
    )


def host_tier_workload(
    model: str = "tiny-random-llama",
    *,
    num_conversations: int = 8,
    num_turns: int = 4,
    first_turn_tokens: int = 192,
    turn_tokens: int = 32,
    output_tokens: int = 16,
    block_size: int = 16,
    prefix_to_pool: float = 4.0,
    host_gib: float = 1.0,
    max_num_batched_tokens: int = 256,
    dtype: str = "float32",
    warmup: bool = True,
    repeats: int = 1,
    interleave: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """(b): multi-turn chat, all conversations' histories ~``prefix_to_pool`` x the device pool.

    The device pool (num_kv_blocks) is sized from the final histories' blocks; the host tier
    has ``host_gib`` GiB (check "num_host_kv_blocks" against "history_blocks": the workload
    means it to hold every history).

    Returns:
        {"settings": {...}, "without": run, "with": run, "same_outputs": bool, "speedup": with /
        without output tokens/s}; a run has prefix_hit_rate, output_tokens_per_s, seconds,
        output_tokens and the counters' deltas (host_cache_hits, device_to_host_bytes, ...).
    """
    from jaxserve import SamplingParams

    rng = random.Random(seed)
    final_len = first_turn_tokens + num_turns * (turn_tokens + output_tokens)
    blocks_per_history = -(-final_len // block_size)
    history_blocks = num_conversations * blocks_per_history
    lengths = (first_turn_tokens, *(turn_tokens,) * (num_turns - 1))
    *workloads, warm_turns = [_chat(rng, num_conversations, lengths) for _ in range(repeats + 1)]
    num_kv_blocks = max(int(history_blocks / prefix_to_pool), blocks_per_history + 1)
    settings = _engine_settings(
        block_size, num_kv_blocks, num_conversations, max_num_batched_tokens,
        final_len + block_size, dtype, warmup,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    engines = {"without": {}, "with": {"kv_offloading_size": host_gib}}
    compared = _compare(model, settings, engines, workloads, warm_turns, params, interleave)
    runs = {name: figures for name, (figures, _) in compared.items()}
    histories = {name: hist for name, (_, hist) in compared.items()}
    info = {**settings, "model": model, "num_conversations": num_conversations,
            "num_turns": num_turns, "history_blocks": history_blocks, "host_gib": host_gib,
            "repeats": repeats, "interleave": interleave}  # fmt: skip
    return {
        "settings": info,
        "without": runs["without"],
        "with": runs["with"],
        "same_outputs": histories["with"] == histories["without"],
        "speedup": runs["with"]["output_tokens_per_s"] / runs["without"]["output_tokens_per_s"],
    }


def preemption_workload(
    model: str = "tiny-random-llama",
    *,
    num_requests: int = 16,
    prompt_tokens: int = 256,
    output_tokens: int = 64,
    block_size: int = 16,
    batch_to_pool: float = 3.0,
    host_gib: float = 1.0,
    max_num_batched_tokens: int = 256,
    modes: tuple[str, ...] = ("recompute", "swap", "auto"),
    dtype: str = "float32",
    warmup: bool = True,
    repeats: int = 1,
    interleave: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """(c): ``num_requests`` at once whose full KV is ``batch_to_pool`` x the device pool, so
    the scheduler preempts; one engine per preemption mode, each with a host tier of
    ``host_gib`` GiB, the same settings otherwise, and one without a host tier (recompute).

    Returns:
        {"settings": {...}, mode: run for each of ``modes``, "recompute_without_host_tier":
        run, "same_outputs": bool, "auto_vs_best_fixed": auto's tokens/s over the better of
        recompute and swap (when all three ran)}; a run has output_tokens_per_s, seconds,
        num_preemptions, num_swap_preemptions, num_swap_fallbacks and the bytes moved.
    """
    from jaxserve import SamplingParams

    rng = random.Random(seed)
    workloads = [
        [[_random_ids(rng, prompt_tokens) for _ in range(num_requests)]] for _ in range(repeats)
    ]
    warm_prompts = [_random_ids(rng, prompt_tokens) for _ in range(num_requests)]
    blocks_per_request = -(-(prompt_tokens + output_tokens) // block_size)
    num_kv_blocks = max(
        int(num_requests * blocks_per_request / batch_to_pool), blocks_per_request + 1
    )
    settings = _engine_settings(
        block_size, num_kv_blocks, num_requests, max_num_batched_tokens,
        prompt_tokens + output_tokens + block_size, dtype, warmup,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    result: dict[str, Any] = {
        "settings": {**settings, "model": model, "num_requests": num_requests,
                     "host_gib": host_gib, "repeats": repeats, "interleave": interleave}
    }  # fmt: skip
    engines = {m: {"preemption_mode": m, "kv_offloading_size": host_gib} for m in modes}
    engines["recompute_without_host_tier"] = {"preemption_mode": "recompute"}
    compared = _compare(model, settings, engines, workloads, [warm_prompts], params, interleave)
    outputs = {}
    for name, (figures, hist) in compared.items():
        result[name], outputs[name] = figures, hist
    result["same_outputs"] = all(o == outputs[modes[0]] for o in outputs.values())
    if {"recompute", "swap", "auto"} <= set(modes):
        best = max(result[m]["output_tokens_per_s"] for m in ("recompute", "swap"))
        result["auto_vs_best_fixed"] = result["auto"]["output_tokens_per_s"] / best
    return result
