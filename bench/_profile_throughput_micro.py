"""bench/profile_throughput.py's microbenchmarks: the jitted step alone and one layer's attention
alone, on synthetic batches whose rows all have one context length.
"""

from __future__ import annotations

import functools
import time

import numpy as np
from _metrics import ModelShape, machine_limits


def synthetic_batch(runner, num_tokens: int, context: int):
    """A real-looking step batch without requests: T tokens spread evenly over R rows (the
    row bucket of T), each row's context `context` positions long, its block table pointing at
    distinct pages; new K/V go to the null block (slot 0), so the pool is never corrupted."""
    from jaxserve.runner.input_batch import PreparedBatch

    bs = runner.block_size
    r = runner.buckets.padded_rows(num_tokens)
    q = num_tokens // r  # tokens per row (1: decode)
    num_blocks = -(-context // bs)
    width = runner.buckets.padded_width(num_blocks)
    batch = PreparedBatch.padding(num_tokens, r, width)
    pages = 1 + (np.arange(r * width) % (runner.num_kv_blocks - 1))
    batch.block_tables[:] = pages.reshape(r, width)
    batch.kv_lens[:] = max(context, q)
    batch.cu_q_lens[:] = np.arange(r + 1) * q
    batch.num_seqs[:] = r
    batch.logits_indices[:] = np.arange(1, r + 1) * q - 1
    batch.positions[:] = np.tile(np.arange(max(context, q) - q, max(context, q)), r)
    return batch


def step_microbench(engine, shape: ModelShape, limits: dict, cases, reps: int) -> list[dict]:
    """The jitted step alone (compiled by warm-up) on synthetic batches of T tokens whose rows
    all have the given context length: greedy and sampled (temperature 1.0)."""
    import jax

    from jaxserve.runner.sampling_metadata import SamplingMetadata

    runner = engine.runner
    rows = []
    for t, ctx in cases:
        # The machine's matmul rate right now: on a shared machine the load drifts, so each
        # case is compared with a matmul (of the run's machine-limits size) timed just before it.
        local_peak = machine_limits(limits["matmul_n"], copy_mib=1, reps=2)["matmul_flops_per_s"]
        batch = synthetic_batch(runner, t, ctx)
        r, width = batch.block_tables.shape
        md = SamplingMetadata.neutral(r, runner.vocab_size)
        md_sampled = SamplingMetadata.neutral(r, runner.vocab_size)
        md_sampled.temperature[:] = 1.0
        row = {"T": t, "R": r, "context": ctx, "B": width}
        for label, smd in (("greedy", md), ("sampled", md_sampled)):
            times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                out, _, _ = runner.run_prepared(batch, smd)
                jax.block_until_ready(out.token_ids)
                times.append(time.perf_counter() - t0)
            row[f"{label}_ms"] = float(np.median(times[1:])) * 1e3
        # Dense matmuls only (attention excluded): how close the step's GEMMs get to the peak.
        flops = 2.0 * shape.layer_matmul_params * t + 2.0 * shape.lm_head_params * r
        row["matmul_flops_per_s"] = flops / (row["greedy_ms"] / 1e3)
        row["local_matmul_flops_per_s"] = local_peak
        row["vs_matmul_peak"] = row["matmul_flops_per_s"] / local_peak
        rows.append(row)
        print(
            f"  T={t:5d} R={r:4d} ctx={ctx:5d} B={width:3d}  greedy {row['greedy_ms']:8.1f} ms  "
            f"sampled {row['sampled_ms']:8.1f} ms  {row['matmul_flops_per_s'] / 1e9:6.1f} "
            f"GFLOP/s dense ({row['vs_matmul_peak']:.0%} of a matmul timed just before: "
            f"{local_peak / 1e9:.0f})",
            flush=True,
        )
    return rows


def _reference_at_width(q, k_pages, v_pages, kv_lens, tables, cu, num_seqs, *, width, sm_scale):
    from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
        ragged_paged_attention_reference,
    )

    return ragged_paged_attention_reference(
        q, k_pages, v_pages, kv_lens, tables[:, :width], cu, num_seqs, sm_scale=sm_scale
    )


def attention_microbench(engine, shape: ModelShape, cases, reps: int) -> list[dict]:
    """One layer's attention op alone on the engine's KV pages, x num_layers: the cpu backend
    (C++ rows), the xla backend with its default tunables and a few others (larger row blocks
    and chunks), and the reference with its width bucket, for T query tokens over R rows at a
    given context."""
    import jax
    import jax.numpy as jnp

    from jaxserve.pallas_kernels.ragged_paged_attention import chunked

    runner = engine.runner
    k_pages, v_pages = runner.kv_caches[0]
    scale = shape.head_dim**-0.5
    out = []
    for t, ctx in cases:
        full = synthetic_batch(runner, t, ctx)
        q = jnp.ones((t, shape.num_heads, shape.head_dim), jnp.float32)
        args = [
            jnp.asarray(x) for x in (full.kv_lens, full.block_tables, full.cu_q_lens, full.num_seqs)
        ]
        # The reference's own width bucket: the power of two >= the context's pages.
        width = 1 << (-(-ctx // runner.block_size) - 1).bit_length()
        blocks = chunked.ROWS_PER_BLOCK
        table_width = full.block_tables.shape[1]
        pages = chunked.chunk_pages(chunked.ROW_CHUNK_POSITIONS, runner.block_size, table_width)
        variants = {
            "cpu rows": dict(row_kernel="cpu"),
            f"xla rows={blocks} pages={pages}": {},
            f"xla rows={blocks * 4} pages={pages}": dict(rows_per_block=blocks * 4),
            f"xla rows={blocks} pages={pages * 4}": dict(pages_per_chunk=pages * 4),
            f"reference B={width}": None,
        }
        row = {"T": t, "R": full.block_tables.shape[0], "context": ctx}
        for label, tunables in variants.items():
            if tunables is None:
                fn = functools.partial(_reference_at_width, width=width, sm_scale=scale)
            else:
                fn = functools.partial(
                    chunked.ragged_paged_attention_chunked, sm_scale=scale, **tunables
                )
            fn = jax.jit(fn)
            jax.block_until_ready(fn(q, k_pages, v_pages, *args))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(q, k_pages, v_pages, *args))
                times.append(time.perf_counter() - t0)
            row[label] = float(np.median(times)) * 1e3 * shape.num_layers
        out.append(row)
        cells = "  ".join(
            f"{k} {v:7.1f}" for k, v in row.items() if k.startswith(("cpu", "xla", "ref"))
        )
        print(
            f"  T={t:5d} R={row['R']:4d} ctx={ctx:5d}  ms per step ({shape.num_layers} layers): "
            f"{cells}",
            flush=True,
        )
    return out
