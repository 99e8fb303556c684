"""CPU attention, side by side: the cpu backend (the CPU default: the xla backend's tiles with
its row pass in the C++ kernel), the plain xla backend at its default and other tunables, and
the jnp reference, on batches shaped like a serving run.

    python bench/attention_cpu.py                      # prints a table, writes JSON
    python bench/attention_cpu.py --reps 3 --out /tmp/a.json

The shapes are the throughput benchmark's model (K=2 KV heads, N=8, H=64) with pages of 32 and
full-width block tables (max_model_len 2048); decode contexts follow the ShareGPT-like lengths
(lognormal around 300, clipped to [20, 2047]). Each case is one layer's attention, median of
--reps timed calls after a warm-up call, every variant checked against the reference.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import jax
import numpy as np

from jaxserve.pallas_kernels.ragged_paged_attention import (
    cpu_rows,
    ragged_paged_attention_chunked,
    ragged_paged_attention_reference,
)
from jaxserve.pallas_kernels.ragged_paged_attention.testing import random_batch
from jaxserve.runner.xla_flags import apply_cpu_workarounds

NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, PAGE = 2, 8, 64, 32
MAX_LEN = 2048
WIDTH = MAX_LEN // PAGE
SCALE = HEAD_DIM**-0.5
RESULTS = Path(__file__).resolve().parent / "results"

VARIANTS = {
    "cpu (default)": dict(row_kernel="cpu"),
    "xla": {},
    "xla rows=8": dict(rows_per_block=8),
    "xla pages=1": dict(pages_per_chunk=1),
    "xla tile=32": dict(tile_rows=32),
}


def sharegpt_contexts(rng: np.random.Generator, n: int) -> list[int]:
    return np.clip(np.exp(rng.normal(np.log(300), 0.8, n)), 20, MAX_LEN - 1).astype(int).tolist()


def long_contexts(rng: np.random.Generator, n: int) -> list[int]:
    return np.clip(rng.normal(1400, 400, n), 300, MAX_LEN - 1).astype(int).tolist()


def cases(rng: np.random.Generator) -> dict[str, tuple[list[tuple[int, int]], int, int]]:
    """name -> ((q_len, kv_len) per sequence, T, R)."""
    return {
        "256 decodes, context 128": ([(1, 128)] * 256, 256, 256),
        "256 decodes, ShareGPT contexts": ([(1, c) for c in sharegpt_contexts(rng, 256)], 256, 256),
        "60 decodes, ShareGPT contexts": ([(1, c) for c in sharegpt_contexts(rng, 60)], 64, 64),
        "5 decodes, ShareGPT contexts": ([(1, c) for c in sharegpt_contexts(rng, 5)], 16, 16),
        # The tail of an offline run: a few long requests left.
        "2 decodes at ~1400 (T=4)": ([(1, c) for c in long_contexts(rng, 2)], 4, 4),
        "11 decodes at ~1400 (T=16)": ([(1, c) for c in long_contexts(rng, 11)], 16, 16),
        "prefill 1 x 2048": ([(2048, 2048)], 2048, 256),
        "prefill 8 x 256": ([(256, 256)] * 8, 2048, 256),
        "256 chunks of 8 at context 128": ([(8, 128)] * 256, 2048, 256),
        "40-token chunk at 600 + 24 decodes": (
            [(40, 600)] + [(1, c) for c in sharegpt_contexts(rng, 24)],
            64,
            64,
        ),
    }


def make_batch(rng: np.random.Generator, seqs: list[tuple[int, int]], t: int, r: int) -> tuple:
    return random_batch(
        seqs,
        num_tokens=t,
        num_slots=r,
        table_width=WIDTH,
        num_q_heads=NUM_Q_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        page_size=PAGE,
        rng=rng,
    )


def time_call(fn, args: tuple, reps: int) -> tuple[float, np.ndarray]:
    out = np.asarray(jax.block_until_ready(fn(*args)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3, out


def main(argv: list[str] | None = None) -> dict:
    apply_cpu_workarounds()  # before jax starts: it runs jax before building an engine
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cases", default="", help="comma list of case-name prefixes (default: all)")
    p.add_argument("--out", default=str(RESULTS / "attention_cpu.json"))
    args = p.parse_args(argv)
    if not cpu_rows.available():
        raise SystemExit(f"the C++ row kernel is unavailable: {cpu_rows.unavailable_reason()}")
    rng = np.random.default_rng(0)
    fns = {
        "reference": jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=SCALE))
    }
    for name, tunables in VARIANTS.items():
        fns[name] = jax.jit(
            functools.partial(ragged_paged_attention_chunked, sm_scale=SCALE, **tunables)
        )
    wanted = [c for c in args.cases.split(",") if c]
    rows = []
    print(f"{'case':38s} " + " ".join(f"{n:>14s}" for n in fns) + "   xla/cpu", flush=True)
    for name, (seqs, t, r) in cases(rng).items():
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        batch = make_batch(rng, seqs, t, r)
        row = {"case": name, "T": t, "R": r, "ms": {}}
        want = None
        for label, fn in fns.items():
            ms, out = time_call(fn, batch, args.reps)
            if want is None:
                want = out
            np.testing.assert_allclose(out, want, atol=1e-4, rtol=1e-4, err_msg=label)
            row["ms"][label] = ms
        row["xla_over_cpu"] = row["ms"]["xla"] / row["ms"]["cpu (default)"]
        rows.append(row)
        cells = " ".join(f"{v:14.2f}" for v in row["ms"].values())
        print(f"{name:38s} {cells}   {row['xla_over_cpu']:6.1f}x", flush=True)
    report = {
        "shape": dict(K=NUM_KV_HEADS, N=NUM_Q_HEADS, H=HEAD_DIM, P=PAGE, table_width=WIDTH),
        "unit": "ms per call, one layer, median",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
        "loadavg": os.getloadavg(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
