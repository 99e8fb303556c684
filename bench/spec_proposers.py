"""The speculative proposers' host time alone, side by side in one run: n-gram against suffix
decoding, per engine step, by batch size (no model: the proposers' cost without the noise of
the device step, which bench/spec_decode.py's propose% column includes).

Each simulated request has a prompt and a hidden continuation; each step the proposers get the
same requests, and a request gains its drafts' longest prefix that agrees with the continuation
plus one token (as a verification step would). Workloads as bench/spec_decode.py's:
"repetitive" (a short span repeated, continued by the span 80% of the time) and "sharegpt"
(lognormal lengths, random tokens). A request that reaches ``max_tokens`` is replaced by a new
one, so the engine-wide suffix tree fills with finished outputs as in serving.

    python bench/spec_proposers.py                      # batch 1, 16, 64, 256
    python bench/spec_proposers.py --batch-sizes 64 --steps 400

Prints a table and writes bench/results/spec_proposers.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from jaxserve.spec_decode.spec_decoder import host_proposer
from jaxserve.speculative_config import SpeculativeConfig

RESULTS = Path(__file__).resolve().parent / "results"
K, VOCAB, MAX_LEN = 4, 2048, 512


def _request(rng, i: int, workload: str, max_tokens: int) -> SimpleNamespace:
    """A request (the fields a proposer reads) and its hidden continuation."""
    if workload == "repetitive":
        span = rng.integers(3, VOCAB, size=int(rng.integers(4, 12))).tolist()
        prompt = (span * MAX_LEN)[: int(rng.integers(64, MAX_LEN // 2))]
        start = len(prompt) % len(span)
        truth = [span[(start + j) % len(span)] for j in range(max_tokens + K + 1)]
        noise = rng.random(len(truth)) < 0.2
        truth = np.where(noise, rng.integers(3, VOCAB, len(truth)), truth).tolist()
    else:
        n = int(np.clip(rng.lognormal(np.log(MAX_LEN / 6), 0.6), 4, MAX_LEN // 2))
        prompt = rng.integers(3, VOCAB, size=n).tolist()
        truth = rng.integers(3, VOCAB, size=max_tokens + K + 1).tolist()
    return SimpleNamespace(request_id=f"r{i}", all_token_ids=list(prompt),
                           num_prompt_tokens=len(prompt), truth=truth)  # fmt: skip


def _run(method: str, workload: str, batch: int, steps: int, max_tokens: int) -> dict:
    proposer = host_proposer(SpeculativeConfig(method=method, num_speculative_tokens=K))
    rng = np.random.default_rng(batch)
    requests = [_request(rng, i, workload, max_tokens) for i in range(batch)]
    seconds, drafted, accepted, served = 0.0, 0, 0, batch
    for _ in range(steps):
        start = time.perf_counter()
        drafts = proposer.propose(requests, K)
        seconds += time.perf_counter() - start
        for j, req in enumerate(requests):
            made = len(req.all_token_ids) - req.num_prompt_tokens
            truth = req.truth[made:]  # longer than any draft list
            guess = drafts.get(req.request_id, [])
            n = next((i for i, d in enumerate(guess) if d != truth[i]), len(guess))
            drafted, accepted = drafted + len(guess), accepted + n
            req.all_token_ids += truth[: n + 1]
            if made + n + 1 >= max_tokens:
                requests[j] = _request(rng, served, workload, max_tokens)
                served += 1
    return {"method": method, "workload": workload, "batch": batch,
            "ms_per_step": 1e3 * seconds / steps, "drafts_per_step": drafted / steps,
            "acceptance": accepted / drafted if drafted else 0.0}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--workloads", default="repetitive,sharegpt")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--output")
    args = p.parse_args(argv)
    print(f"{'workload':<11}{'batch':>6} {'proposer':<9}{'ms/step':>9}{'x ngram':>9}"
          f"{'drafts/step':>12}{'accept':>8}", flush=True)  # fmt: skip
    rows = []
    for workload in args.workloads.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            pair = [_run(m, workload, batch, args.steps, args.max_tokens)
                    for m in ("ngram", "suffix")]  # fmt: skip
            for row in pair:
                row["x_ngram"] = row["ms_per_step"] / max(pair[0]["ms_per_step"], 1e-9)
                print(f"{workload:<11}{batch:>6} {row['method']:<9}{row['ms_per_step']:>9.2f}"
                      f"{row['x_ngram']:>9.2f}{row['drafts_per_step']:>12.1f}"
                      f"{row['acceptance']:>8.2f}", flush=True)  # fmt: skip
            rows += pair
    report = {"k": K, "steps": args.steps, "max_tokens": args.max_tokens, "rows": rows}
    out = Path(args.output) if args.output else RESULTS / "spec_proposers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
