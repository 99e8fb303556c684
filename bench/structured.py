"""Structured outputs, side by side in one run: output tok/s with 0%, 20%, 80% and 100% of the
requests constrained by a JSON schema, on one engine (one compilation), with the token masks
built overlapped with the device's step or not, and the host time each step spends on them.

Each row serves the same prompts with the same sampled settings (temperature 1, seeded); the
constrained requests carry ``structured_outputs=StructuredOutputsParams(json=SCHEMA)`` and end
when their JSON does, the others run with ignore_eos to the length the same request's JSON had
(measured in a first, constrained pass): every row generates the same tokens per request and
runs the same schedule, so the rows differ only in the constraint. Output tok/s counts
every generated token over the run's wall time, the best of ``--repeats`` rounds over every
row (the machine's load drifts between rows); "vs 0%" is the ratio to the unconstrained row
of the same mode, and "rounds" the median over the rounds of that ratio within each round (the
two rows of a round run seconds apart, under the same load: the steadier estimate on a shared
machine, where the best rounds of two rows may come from different moments).
A second, traced pass of each row gives the host phases per step: "masks" is the
building of the constrained requests' masks (in "schedule" where they are built right after
scheduling), "update" includes advancing their matchers; "cpu ms" is the CPU time of that pass
per step over all threads (the engine's, XLA's, the grammar library's), "eng cpu" the engine
thread's alone: on a CPU device every thread shares the cores, and CPU time is steadier than
wall time on a shared machine.

Each fraction runs in three modes (``--modes``), on the same compiled engine:

    overlapped   async scheduling; a step with constrained requests runs its forward half
                 while the step before is learned, and its masks are built meanwhile
                 (EngineCore: the step's two halves)
    post-learn   async scheduling, but a step with constrained requests waits for the step
                 before to be learned, then builds its masks and runs whole (the engine before
                 the split: EngineCore.overlap_masks = False)
    sync         no async scheduling: every step waits for the one before

    python bench/structured.py                     # the demo model, 64 requests
    python bench/structured.py --model path/to/hf_checkpoint --num-requests 256
    python bench/structured.py --num-requests 4 --max-tokens 8 --fractions 0,1   # a smoke run
    python bench/structured.py --speculative-config '{"method": "ngram", "policy": "always"}'

With ``--speculative-config`` every row speculates (drafts checked against the grammar, a mask
per verification row); seeded drafts keep every row's tokens those without speculation, and
the rows report the drafts verified and accepted. Speculating steps wait for the step before
(drafts need its tokens): the three modes differ only in the steps that do not speculate.

Prints a table and writes bench/results/structured.json (or --output).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from jaxserve import LLM, SamplingParams, StructuredOutputsParams

RESULTS = Path(__file__).resolve().parent / "results"
FRACTIONS = (0.0, 0.2, 0.8, 1.0)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


def _params(lengths: list[int], fraction: float) -> list[SamplingParams]:
    """round(n * fraction) requests constrained, spread evenly over the batch; request i
    generates lengths[i] tokens either way (the length of its constrained JSON), so that every
    row runs the same schedule and only the constraint differs."""
    n = len(lengths)
    num_constrained = round(n * fraction)
    constrained = set(np.linspace(0, n - 1, num_constrained).round().astype(int).tolist())
    structured = StructuredOutputsParams(json=SCHEMA)
    return [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=length,
            ignore_eos=i not in constrained,
            structured_outputs=structured if i in constrained else None,
        )
        for i, length in enumerate(lengths)
    ]


MODES = {  # name -> (async scheduling, masks overlapped with the forward)
    "overlapped": (True, True),
    "post-learn": (True, False),
    "sync": (False, False),
}


def _set_mode(llm: LLM, mode: str) -> None:
    """Switch the engine's async scheduling and mask overlap (no compilation: the same
    executables serve every mode)."""
    on, overlap = MODES[mode]
    core = llm.engine.core
    core.reset_scheduler(async_scheduling=on)
    core.overlap_masks = overlap


def _row(llm: LLM, prompts: list[list[int]], fraction: float, lengths: list[int], mode: str,
         walls: list[float]) -> dict:  # fmt: skip
    """The row of one fraction and mode: its timed passes' best wall time (``walls``, one per
    repeat), then one traced pass for the host phases."""
    _set_mode(llm, mode)
    params = _params(lengths, fraction)
    before = llm.get_stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.get_stats()
    spec = {
        key: after.get(key, 0) - before.get(key, 0)
        for key in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    }
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    valid = sum(
        1
        for o, p in zip(outs, params, strict=True)
        if p.structured_outputs is not None and _is_json(o.outputs[0].text)
    )
    traces = []
    llm.engine.set_step_tracer(traces.append)
    cpu0, engine0 = _process_cpu_s(), time.thread_time()
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.set_step_tracer(None)
    cpu_s, engine_cpu_s = _process_cpu_s() - cpu0, time.thread_time() - engine0
    mean_ms = lambda field: 1e3 * float(np.mean([getattr(t, field) for t in traces]))  # noqa: E731
    wall = min(walls)
    return {
        "fraction_constrained": fraction,
        "mode": mode,
        "output_tokens": tokens,
        "token_ids": [o.outputs[0].token_ids for o in outs],
        "wall_s": wall,
        "wall_s_repeats": walls,
        "output_tok_per_s": tokens / wall,
        "constrained_valid": valid,  # complete JSON (the rest hit max_tokens)
        "constrained": sum(p.structured_outputs is not None for p in params),
        "steps": len(traces),
        **{f"{f}_ms_per_step": mean_ms(f"{f}_s") for f in
           ("schedule", "masks", "update", "execute", "prepare", "device", "device_idle")},
        "mean_rows_per_step": float(np.mean([len(t.q_lens) for t in traces])),
        # CPU of the traced pass per step: every thread (the engine's, XLA's, the grammar
        # library's), and the engine thread's alone; steadier than wall time on a shared machine
        "cpu_ms_per_step": 1e3 * cpu_s / len(traces),
        "engine_thread_cpu_ms_per_step": 1e3 * engine_cpu_s / len(traces),
        "draft_tokens": spec["spec_decode_num_draft_tokens"],
        "accepted_tokens": spec["spec_decode_num_accepted_tokens"],
    }  # fmt: skip


def _timed(llm: LLM, prompts: list[list[int]], fractions: list[float], modes: list[str],
           lengths: list[int], repeats: int) -> dict[tuple[float, str], list[float]]:  # fmt: skip
    """Wall seconds of every (fraction, mode), ``repeats`` rounds over all of them (the
    machine's load drifts: each row keeps its best round)."""
    walls: dict[tuple[float, str], list[float]] = {(f, m): [] for f in fractions for m in modes}
    for _ in range(repeats):
        for f in fractions:
            params = _params(lengths, f)
            for m in modes:
                _set_mode(llm, m)
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                walls[(f, m)].append(time.perf_counter() - start)
    return walls


def _process_cpu_s() -> float:
    """User + system CPU seconds of this process so far, all threads."""
    t = os.times()
    return t.user + t.system


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-random-llama")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds; each row's best")
    ap.add_argument("--speculative-config", type=json.loads, default=None)
    ap.add_argument("--output", type=Path, default=RESULTS / "structured.json")
    args = ap.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    modes = args.modes.split(",")
    if not fractions or any(not 0.0 <= f <= 1.0 for f in fractions):
        ap.error(f"--fractions must be in [0, 1], got {args.fractions!r}")
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
    llm = LLM(
        args.model,
        warmup=True,  # every shape before the timed runs
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_num_seqs),
        speculative_config=args.speculative_config,
    )
    vocab = llm.engine.info.vocab_size
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(3, vocab, size=args.prompt_len).tolist() for _ in range(args.num_requests)
    ]
    # Each request's constrained length (the grammar compiles here too): every row then
    # generates exactly these lengths.
    calibration = llm.generate(
        prompts, _params([args.max_tokens] * len(prompts), 1.0), use_tqdm=False
    )
    lengths = [len(o.outputs[0].token_ids) for o in calibration]
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    walls = _timed(llm, prompts, fractions, modes, lengths, args.repeats)
    rows = [_row(llm, prompts, f, lengths, m, walls[(f, m)]) for f in fractions for m in modes]
    _report(rows, fractions, modes)
    recompiled = llm.get_stats()["recompilations"]
    print(f"compilations after warm-up: {len(recompiled)}")
    result = {
        "model": args.model,
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows],
        "recompilations_after_warmup": recompiled,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _report(rows: list[dict], fractions: list[float], modes: list[str]) -> None:
    """Each row's ratios (to the unconstrained row of its mode, and to the same fraction's
    first mode), whether every mode generated the same tokens, and the table."""
    by = {(r["fraction_constrained"], r["mode"]): r for r in rows}
    for r in rows:
        base = by.get((0.0, r["mode"]))
        first = by[(r["fraction_constrained"], modes[0])]
        r["vs_unconstrained"] = r["output_tok_per_s"] / base["output_tok_per_s"] if base else None
        # Round by round: the two rows of a round ran seconds apart, under the same load.
        r["vs_unconstrained_rounds"] = (
            float(np.median(np.divide(base["wall_s_repeats"], r["wall_s_repeats"])))
            if base
            else None
        )
        r[f"vs_{modes[0]}"] = r["output_tok_per_s"] / first["output_tok_per_s"]
        r["same_tokens"] = r["token_ids"] == first["token_ids"]
    print(f"{'constrained':>11} {'mode':>10} {'tok/s':>9} {'vs 0%':>6} {'rounds':>6} "
          f"{'vs ' + modes[0]:>14} "
          f"{'same':>5} {'valid':>7} {'sched ms':>9} {'masks ms':>9} {'update ms':>9} "
          f"{'exec ms':>8} {'device ms':>9} {'idle ms':>8} {'cpu ms':>7} {'eng cpu':>7} "
          f"{'rows':>5} {'drafts':>7} {'accepted':>8}")  # fmt: skip
    for f in fractions:
        for m in modes:
            r = by[(f, m)]
            vs0 = "" if r["vs_unconstrained"] is None else f"{r['vs_unconstrained']:.2f}"
            rounds = r["vs_unconstrained_rounds"]
            rounds = "" if rounds is None else f"{rounds:.2f}"
            print(
                f"{f:>10.0%} {m:>11} {r['output_tok_per_s']:>9.1f} {vs0:>6} {rounds:>6} "
                f"{r[f'vs_{modes[0]}']:>14.2f} {'yes' if r['same_tokens'] else 'NO':>5} "
                f"{r['constrained_valid']:>3}/{r['constrained']:<3} "
                f"{r['schedule_ms_per_step']:>9.3f} {r['masks_ms_per_step']:>9.3f} "
                f"{r['update_ms_per_step']:>9.3f} {r['execute_ms_per_step']:>8.2f} "
                f"{r['device_ms_per_step']:>9.2f} {r['device_idle_ms_per_step']:>8.2f} "
                f"{r['cpu_ms_per_step']:>7.2f} {r['engine_thread_cpu_ms_per_step']:>7.2f} "
                f"{r['mean_rows_per_step']:>5.1f} {r['draft_tokens']:>7} "
                f"{r['accepted_tokens']:>8}"
            )


if __name__ == "__main__":
    main()
