"""Speculative decoding, side by side in one run: output tok/s with and without it, by batch size.

Engines (one checkpoint, one process, the same greedy requests with ignore_eos and a fixed
max_tokens, so every engine generates the same tokens, which the script checks). "Batch" B is
the concurrency: each run serves 4 * B requests, B at a time, a new one added as soon as one
finishes, as in serving (a closed batch of B would wait for its slowest request, whatever the
others gained). One engine per method serves every B (max_num_seqs = the largest):

    plain        no speculation
    ngram        n-gram drafts, policy "always" (speculates at every batch size)
    ngram-auto   n-gram drafts, the automatic policy (stops where speculating would lose)
    suffix       suffix decoding, policy "always" (the request's own tokens and the engine's
                 earlier outputs)
    oracle       drafts that are always right (the plain run's own tokens): the mechanism's
                 ceiling, what n-gram reaches on outputs that quote their inputs
    draft=target the draft_model method with the target as its own draft: acceptance 1, and
                 each draft token costs a draft step of the target's size (no speed-up: the
                 method's overheads, measured)
    draft-small  a one-layer draft (random weights, so it rarely agrees with the target)

The policy's choices ("auto" rows): its steps by drafts per decode, and the fastest arm it
measured in each batch bucket (k drafts, "fit": as many as the step's padding holds, or off).
Also the cost of a verification step: the oracle's steps of 1 + k tokens against the plain
engine's one-token decode steps at batch 1 (device time, from the step tracer), and the
proposer's host time as a share of each run's wall time ("propose%", get_stats()'s
spec_decode_proposer_seconds; the oracle's is a dict lookup). Last, a draft model's acceptance
on random requests: sampled drafts (unseeded) against greedy ones (seeded).

Workloads: "repetitive" (prompts made of a span repeated, the case prompt lookup is for) and
"sharegpt" (bench/_datasets.py's lognormal lengths). A random-weight checkpoint never quotes its
input the way a summariser does, so n-gram's acceptance here is what the model's own loops give;
the oracle row shows what acceptance 1 is worth on this machine.

    python bench/spec_decode.py                          # the 57M preset, batch 1, 4, 16
    python bench/spec_decode.py --preset quick --batch-sizes 1,4,16,64,256
    python bench/spec_decode.py --methods ngram,ngram-auto --no-extras --step-costs
    python bench/spec_decode.py --methods ngram-auto --no-extras --repeats 5   # x plain: median

Prints a table and writes bench/results/spec_decode[_<preset>].json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from throughput import CACHE, PRESETS, ensure_checkpoint

from jaxserve import LLM, SamplingParams
from jaxserve.spec_decode import SpecDecoder
from jaxserve.speculative_config import SpeculativeConfig

RESULTS = Path(__file__).resolve().parent / "results"
K = 4


class _Oracle:
    """Always-right drafts: each request's tokens from the plain run."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.reference = reference

    def propose(self, requests, k):
        out = {}
        for req in requests:
            known = self.reference.get(tuple(req.prompt_token_ids))
            if known is None:  # a warm-up request: no guess
                continue
            full = list(req.prompt_token_ids) + known
            n = len(req.all_token_ids)
            out[req.request_id] = full[n : n + k]
        return out


def _prompts(workload: str, n: int, vocab: int, max_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if workload == "repetitive":
        out = []
        for _ in range(n):
            span = rng.integers(3, vocab, size=int(rng.integers(4, 12))).tolist()
            out.append((span * (max_len // len(span)))[: max_len // 2])
        return out
    lengths = np.clip(rng.lognormal(np.log(max_len / 6), 0.6, size=n), 4, max_len // 2)
    return [rng.integers(3, vocab, size=int(m)).tolist() for m in lengths]


def _run(llm: LLM, prompts, params, concurrency: int) -> tuple[float, list[list[int]], dict]:
    """Serve ``prompts`` with at most ``concurrency`` in flight; (seconds, tokens, stats)."""
    engine, before = llm.engine, llm.get_stats()
    tokens: dict[int, list[int]] = {}
    pending = list(enumerate(prompts))
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(engine.scheduler.requests) < concurrency:
            i, prompt = pending.pop(0)
            engine.add_request(f"b{i}", {"prompt_token_ids": prompt}, params)
        for out in engine.step(finished_only=True):
            tokens[int(out.request_id[1:])] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    after = llm.get_stats()
    delta = {
        key: after.get(key, 0) - before.get(key, 0)
        for key in ("num_steps", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                    "spec_decode_proposer_seconds")
    }  # fmt: skip
    # The policy's decisions in this run, by drafts per decode, and its best arm per batch bucket
    key = "spec_decode_policy_steps_per_length"
    per_length = zip(after.get(key, []), before.get(key, []), strict=False)
    delta["steps_per_length"] = {n: a - b for n, (a, b) in enumerate(per_length) if a > b}
    delta["best_arm"] = after.get("spec_decode_policy_best_arm", {})
    return seconds, [tokens[i] for i in range(len(prompts))], delta


def _measure(plain, name, llm, workloads, batch, params, repeats: int = 1) -> list[dict]:
    """One method against the plain engine at one concurrency, each workload run by the two
    back to back (a ratio of neighbours: the machine's drift cancels), ``repeats`` pairs in
    turn: the row's ratio is their median (the "auto" policy keeps learning across them, as
    in a long-running engine); steps, drafts and acceptance are the last pair's."""
    rows = []
    for workload, prompts in workloads.items():
        ratios, times = [], []
        for _ in range(repeats):
            base_s, reference, _ = _run(plain, prompts, params, batch)
            if name == "oracle":
                oracle = _Oracle({tuple(q): r for q, r in zip(prompts, reference, strict=True)})
                config = SpeculativeConfig(method="ngram", num_speculative_tokens=K,
                                           policy="always")  # fmt: skip
                llm.engine.core.spec = SpecDecoder(config, proposer=oracle)
            seconds, tokens, delta = _run(llm, prompts, params, batch)
            differ = [_divergence(t, r) for t, r in zip(tokens, reference, strict=True)]
            differ = [d for d in differ if d is not None]
            if differ:  # reported, and the exit status says so (see _divergence)
                print(f"! {name} at batch {batch}: {len(differ)} of {len(prompts)} requests' "
                      f"greedy tokens differ from plain's, first at token {min(differ)}",
                      flush=True)  # fmt: skip
            ratios.append(base_s / seconds)
            times.append(seconds)
        drafts = delta["spec_decode_num_draft_tokens"]
        rows.append(dict(
            workload=workload, batch=batch, engine=name,
            output_tok_s=len(prompts) * params.max_tokens / float(np.median(times)),
            ratio=float(np.median(ratios)), ratios=ratios, steps=delta["num_steps"],
            draft_tokens=drafts,
            acceptance=delta["spec_decode_num_accepted_tokens"] / drafts if drafts else None,
            proposer_share=delta["spec_decode_proposer_seconds"] / seconds,
            steps_per_length=delta["steps_per_length"], best_arm=delta["best_arm"],
            greedy_mismatches=len(differ), first_divergence=min(differ, default=None),
        ))  # fmt: skip
        _print_row(rows[-1])
    return rows


def _divergence(tokens: list[int], reference: list[int]) -> int | None:
    """The index of the first token where ``tokens`` leaves ``reference`` (None: equal).

    Speculation keeps greedy output exactly when the target's logits for a position do not
    depend on how many tokens the step scores: true in float32 on the CPU (every test checks
    it), not in bf16 on a GPU, where a step of 5 tokens a request runs other matmul shapes
    (other tilings, other summation orders) than a one-token decode and a near-tie between
    the top two logits can flip (the first H100 run: batch 16 of the 57M random model). The
    plain engine's own output changes with its batch's shapes in the same way."""
    if tokens == reference:
        return None
    pairs = enumerate(zip(tokens, reference, strict=False))
    return next((i for i, (a, b) in pairs if a != b),
                min(len(tokens), len(reference)))  # fmt: skip


def _plain_variance(plain, args, vocab: int, max_len: int, params) -> list[dict]:
    """The plain engine against itself: each batch size's prompts served at that concurrency
    and one at a time, and the requests whose greedy tokens differ. Speculation cannot keep
    tokens that the batch's own shapes change (_divergence): this is that bound."""
    rows = []
    for batch in (b for b in (int(b) for b in args.batch_sizes.split(",")) if b > 1):
        for workload in args.workloads.split(","):
            prompts = _prompts(workload, batch * args.requests_per_slot, vocab, max_len, batch)
            _, together, _ = _run(plain, prompts, params, batch)
            _, alone, _ = _run(plain, prompts, params, 1)
            differ = [d for d in map(_divergence, together, alone) if d is not None]
            first = min(differ, default=None)
            rows.append(dict(workload=workload, batch=batch, requests=len(prompts),
                             differ=len(differ), first_divergence=first))  # fmt: skip
            print(f"plain at batch {batch} against one at a time ({workload}): {len(differ)} of "
                  f"{len(prompts)} requests' greedy tokens differ", flush=True)  # fmt: skip
    return rows


def _print_row(r: dict) -> None:
    acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
    head = f"{r['workload']:<11}{r['batch']:>6} {r['engine']:<13}{r['output_tok_s']:>9.1f}"
    tail = f"{r['steps']:>7}{r['draft_tokens']:>8}{acc:>8}{100 * r['proposer_share']:>9.1f}"
    lengths = " ".join(f"{n}:{c}" for n, c in r["steps_per_length"].items())
    best = " ".join(f"{b}:{arm}" for b, arm in r["best_arm"].items())
    arms = f"  {lengths} | {best}" if best else ""
    spread = f"  ({min(r['ratios']):.2f}-{max(r['ratios']):.2f})" if len(r["ratios"]) > 1 else ""
    print(f"{head}{r['ratio']:>9.2f}{tail}{arms}{spread}", flush=True)


def _verification_cost(folder, engine_kw, vocab, max_len) -> dict:
    """Median device time of the oracle's 1 + k token steps over the plain engine's one-token
    decode steps, one request at a time (the step tracer)."""
    prompt = _prompts("sharegpt", 1, vocab, max_len, seed=99)[0]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    kw = {**engine_kw, "max_num_seqs": 1}
    times = {}
    for name, spec in (("plain", None), ("spec", {"method": "ngram", "num_speculative_tokens": K,
                                                  "policy": "always"})):  # fmt: skip
        llm = LLM(str(folder), speculative_config=spec, **kw)
        _, reference, _ = _run(llm, [prompt], params, 1)  # also warms the buckets
        if spec is not None:
            llm.engine.core.spec = SpecDecoder(
                SpeculativeConfig(**spec), proposer=_Oracle({tuple(prompt): reference[0]})
            )
        traces = []
        llm.engine.core.set_step_tracer(traces.append)
        _run(llm, [prompt], params, 1)
        want = 1 if spec is None else 1 + K
        times[name] = float(np.median([t.device_s for t in traces if t.num_tokens == want]))
    return {"plain_ms": 1e3 * times["plain"], "spec_ms": 1e3 * times["spec"],
            "ratio": times["spec"] / times["plain"]}  # fmt: skip


def _step_costs(folder, engine_kw, vocab, max_len, max_batch: int = 8) -> dict[int, float]:
    """Median device ms of the plain engine's decode steps of T = 1..max_batch tokens (T
    requests decoding together; the step pads T to its token bucket): what a verification
    step of T tokens costs, and where drafts fill padding for free."""
    llm = LLM(str(folder), **{**engine_kw, "max_num_seqs": max_batch, "warmup": False})
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    buckets = llm.engine.core.runner.buckets.token_buckets
    print(f"\n{'T':>3}{'pads to':>9}{'device ms':>11}")
    out = {}
    for t in range(1, max_batch + 1):
        prompts = _prompts("sharegpt", t, vocab, max_len, seed=100 + t)
        _run(llm, prompts, params, t)  # compiles the buckets it meets
        traces = []
        llm.engine.core.set_step_tracer(traces.append)
        _run(llm, prompts, params, t)
        llm.engine.core.set_step_tracer(None)
        out[t] = 1e3 * float(np.median([x.device_s for x in traces if x.num_tokens == t]))
        pad = next(b for b in buckets if b >= t)
        print(f"{t:>3}{pad:>9}{out[t]:>11.2f}", flush=True)
    return out


def _sampled_drafts(drafts: dict[str, str], folder, engine_kw, vocab, max_len) -> dict:
    """Acceptance of a draft model's drafts for random requests (temperature 1): unseeded
    ones get sampled drafts (the general-q rule), seeded ones greedy drafts (one-hot: accepted
    with probability p(argmax)); 16 ShareGPT-like requests each, 32 tokens."""
    prompts = _prompts("sharegpt", 16, vocab, max_len, seed=7)
    out = {}
    print(f"\n{'draft (temperature 1)':<24}{'sampled drafts':>16}{'greedy drafts':>15}")
    for name, model in drafts.items():
        spec = {"method": "draft_model", "model": model, "num_speculative_tokens": K,
                "policy": "always"}  # fmt: skip
        llm = LLM(str(folder), speculative_config=spec, **engine_kw)
        row = {}
        for mode, seed in (("sampled", None), ("greedy", 1)):
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=32, ignore_eos=True)
            _, _, delta = _run(llm, prompts, params, 16)
            drafts_n = delta["spec_decode_num_draft_tokens"]
            row[mode] = delta["spec_decode_num_accepted_tokens"] / drafts_n if drafts_n else None
        del llm
        out[name] = row
        print(f"{name:<24}{row['sampled']:>16.2f}{row['greedy']:>15.2f}", flush=True)
    return out


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--workloads", default="repetitive,sharegpt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-per-slot", type=int, default=4)
    p.add_argument("--methods", help="comma list of the engines to run (default: all)")
    p.add_argument("--output")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="plain / method pairs per row, alternated; the row's x plain is their median",
    )
    p.add_argument(
        "--no-extras",
        dest="extras",
        action="store_false",
        help="skip the verification-step cost and the sampled-drafts runs",
    )
    p.add_argument(
        "--no-sampled-drafts",
        dest="sampled_drafts",
        action="store_false",
        help="with the extras, skip the sampled-drafts runs (the verification cost only)",
    )
    p.add_argument(
        "--plain-variance",
        action="store_true",
        help="also the plain engine against itself: each batch's prompts at that concurrency "
        "and one at a time (greedy tokens that differ: batch variance)",
    )
    p.add_argument(
        "--step-costs",
        action="store_true",
        help="also the plain engine's decode steps' device time by token count",
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    preset = PRESETS[args.preset]
    folder = ensure_checkpoint(preset, CACHE)
    engine_kw = dict(preset.engine, warmup=True)  # every shape before the timed runs
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine_kw["max_num_seqs"] = max(batch_sizes)
    max_len = engine_kw["max_model_len"]
    max_tokens = min(args.max_tokens, max_len // 2 - 1)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": K}
    draft = replace(preset, model_name=preset.model_name + "-draft",
                    model={**preset.model, "num_hidden_layers": 1})  # fmt: skip
    draft_folder = ensure_checkpoint(draft, CACHE)
    always = {**ngram, "policy": "always"}
    specs = {
        "ngram": always, "ngram-auto": ngram, "oracle": always,
        "suffix": {**always, "method": "suffix"},
        "draft=target": {**always, "method": "draft_model", "model": str(folder)},
        "draft-small": {**always, "method": "draft_model", "model": str(draft_folder)},
    }  # fmt: skip
    vocab = preset.model["vocab_size"]
    print(f"{'workload':<11}{'batch':>6} {'engine':<13}{'tok/s':>9}{'x plain':>9}"
          f"{'steps':>7}{'drafts':>8}{'accept':>8}{'propose%':>9}"
          "  policy steps by drafts/decode | best arm by batch bucket", flush=True)  # fmt: skip
    suffix = "" if args.preset == "default" else f"_{args.preset}"
    out = Path(args.output) if args.output else RESULTS / f"spec_decode{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"preset": args.preset, "k": K, "max_tokens": max_tokens, "repeats": args.repeats,
              "rows": [], "complete": False}  # fmt: skip
    plain = LLM(str(folder), **engine_kw)
    if args.plain_variance:  # first: the bound on the rows below (and cheap)
        report["plain_batch_variance"] = _plain_variance(plain, args, vocab, max_len, params)
    if args.methods:
        specs = {name: specs[name] for name in args.methods.split(",")}
    for name, spec in specs.items():  # one method's engine at a time (memory maps)
        llm = LLM(str(folder), speculative_config=spec, **engine_kw)
        for batch in batch_sizes:
            n = batch * args.requests_per_slot
            workloads = {w: _prompts(w, n, vocab, max_len, seed=batch)
                         for w in args.workloads.split(",")}  # fmt: skip
            report["rows"] += _measure(plain, name, llm, workloads, batch, params, args.repeats)
            out.write_text(json.dumps(report, indent=1))  # so far: a run cut short keeps it
        del llm
    del plain
    if args.step_costs:
        report["step_ms_by_tokens"] = _step_costs(folder, engine_kw, vocab, max_len)
    if args.extras:
        _extras(args, report, folder, draft_folder, engine_kw, vocab, max_len)
    report["complete"] = True
    out.write_text(json.dumps(report, indent=1))
    return report


def _extras(args, report, folder, draft_folder, engine_kw, vocab, max_len) -> None:
    """The verification step's cost, and (unless --no-sampled-drafts) sampled drafts' acceptance."""
    cost = _verification_cost(folder, engine_kw, vocab, max_len)
    report["verification_cost"] = cost
    print(
        f"\nbatch 1: a verification step of {1 + K} tokens takes {cost['ratio']:.2f}x a "
        f"one-token decode step ({cost['spec_ms']:.2f} vs {cost['plain_ms']:.2f} ms, device)",
        flush=True,
    )
    if args.sampled_drafts:
        report["sampled_drafts"] = _sampled_drafts(
            {"draft=target": str(folder), "draft-small": str(draft_folder)},
            folder, engine_kw, vocab, max_len,
        )  # fmt: skip


if __name__ == "__main__":
    rows = main()["rows"]
    # A greedy token that speculation changed fails the run (after it has measured everything).
    sys.exit(1 if any(r["greedy_mismatches"] for r in rows) else 0)
