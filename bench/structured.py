"""Structured outputs, side by side in one run: output tok/s with 0%, 20%, 80% and 100% of the
requests constrained by a JSON schema, on one engine (one compilation), and the host time each
step spends on token masks.

Each row serves the same prompts with the same sampled settings (temperature 1, seeded); the
constrained requests carry ``structured_outputs=StructuredOutputsParams(json=SCHEMA)`` and end
when their JSON does, the others run with ignore_eos to the length the same request's JSON had
(measured in a first, constrained pass): every row generates the same tokens per request and
runs the same schedule, so the rows differ only in the constraint. Output tok/s counts
every generated token over the run's wall time; "vs 0%" is the ratio to the unconstrained row.
A second, traced pass of each row (the step tracer waits for the device each step) gives the
host phases per step: "schedule" includes building the masks of the constrained requests,
"update" includes advancing their matchers.

Masks are built on the host between steps, not overlapped with the device's step (the engine
steps synchronously): there is no "overlapped" row.

    python bench/structured.py                     # the demo model, 64 requests
    python bench/structured.py --model path/to/hf_checkpoint --num-requests 256
    python bench/structured.py --speculative-config '{"method": "ngram", "policy": "always"}'

With ``--speculative-config`` every row speculates (drafts checked against the grammar, a mask
per verification row); seeded drafts keep every row's tokens those without speculation, and
the rows report the drafts verified and accepted.

Prints a table and writes bench/results/structured.json (or --output).
"""

from __future__ import annotations

import argparse
import json
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


def _row(llm: LLM, prompts: list[list[int]], fraction: float, lengths: list[int]) -> dict:
    params = _params(lengths, fraction)
    before = llm.get_stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
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
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.set_step_tracer(None)
    return {
        "fraction_constrained": fraction,
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_per_s": tokens / wall,
        "constrained_valid": valid,  # complete JSON (the rest hit max_tokens)
        "constrained": sum(p.structured_outputs is not None for p in params),
        "steps": len(traces),
        "schedule_ms_per_step": 1e3 * float(np.mean([t.schedule_s for t in traces])),
        "update_ms_per_step": 1e3 * float(np.mean([t.update_s for t in traces])),
        "execute_ms_per_step": 1e3 * float(np.mean([t.execute_s for t in traces])),
        "prepare_ms_per_step": 1e3 * float(np.mean([t.prepare_s for t in traces])),
        "device_ms_per_step": 1e3 * float(np.mean([t.device_s for t in traces])),
        "mean_rows_per_step": float(np.mean([len(t.q_lens) for t in traces])),
        "draft_tokens": spec["spec_decode_num_draft_tokens"],
        "accepted_tokens": spec["spec_decode_num_accepted_tokens"],
    }


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
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--speculative-config", type=json.loads, default=None)
    ap.add_argument("--output", type=Path, default=RESULTS / "structured.json")
    args = ap.parse_args(argv)
    llm = LLM(
        args.model,
        warmup=True,  # every shape before the timed runs
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=max(256, args.max_num_seqs),
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
    rows = [_row(llm, prompts, f, lengths) for f in FRACTIONS]
    base = rows[0]["output_tok_per_s"]
    print(f"{'constrained':>11} {'tok/s':>9} {'vs 0%':>6} {'valid':>7} {'sched ms':>9} "
          f"{'update ms':>9} {'exec ms':>8} {'prep ms':>8} {'device ms':>9} "
          f"{'rows':>5} {'drafts':>7} {'accepted':>8}")  # fmt: skip
    for r in rows:
        r["vs_unconstrained"] = r["output_tok_per_s"] / base
        print(
            f"{r['fraction_constrained']:>10.0%} {r['output_tok_per_s']:>9.1f} "
            f"{r['vs_unconstrained']:>6.2f} {r['constrained_valid']:>3}/{r['constrained']:<3} "
            f"{r['schedule_ms_per_step']:>9.3f} {r['update_ms_per_step']:>9.3f} "
            f"{r['execute_ms_per_step']:>8.2f} {r['prepare_ms_per_step']:>8.3f} "
            f"{r['device_ms_per_step']:>9.2f} {r['mean_rows_per_step']:>5.1f} "
            f"{r['draft_tokens']:>7} {r['accepted_tokens']:>8}"
        )
    recompiled = llm.get_stats()["recompilations"]
    print(f"compilations after warm-up: {len(recompiled)}")
    result = {
        "model": args.model,
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "recompilations_after_warmup": recompiled,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
