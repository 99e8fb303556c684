"""Where jaxserve's time goes on bench/throughput.py's model: host vs device per step, padding,
attention vs context bucket, sampling, compilations.

    python bench/profile_throughput.py [--preset default] [--concurrency 256]

Four parts, one warmed-up engine (the benchmark's preset and checkpoint):

    steps      the jitted step alone on synthetic batches of T tokens whose rows all have one
               context length, greedy and sampled (temperature 1.0): ms per call, dense
               FLOP/s against the matmul measured here, and how attention's cost grows with
               the context
    attention  one layer's attention op alone (x layers) at given contexts: the xla backend at
               several chunk sizes and the reference with its width bucket
    sharegpt   the benchmark's ShareGPT-like offline run, every step instrumented: scheduler,
               input preparation, the step call, waiting for the device, update_from_output,
               the engine's output processing; padding of T, R and of attention's width
    decode     `--concurrency` requests of 128 prompt tokens admitted together; once all of
               them decode, `--decode-steps` steps are timed the same way and profiled with
               cProfile (host functions by own time)

The engine steps as LLM.generate steps it (step(finished_only=True): no RequestOutput per
running request per step); `--every-step-outputs` times what a streaming caller pays instead.

Instrumentation wraps methods of this engine instance (nothing in jaxserve is edited): the
step wrapper waits for the step's sampled ids, so "device" is dispatch-to-ready time and every
other millisecond of an engine step is host time. On this CPU the host and XLA share the same
cores: host work can only hide behind device work to the extent cores are idle.

Writes bench/results/throughput_profile.json and prints tables.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _datasets  # noqa: E402
import _jaxserve_runs  # noqa: E402
import numpy as np  # noqa: E402
import throughput  # noqa: E402
from _metrics import ModelShape, machine_limits  # noqa: E402

from jaxserve.runner.xla_flags import apply_cpu_workarounds  # noqa: E402

# ---- instrumentation ------------------------------------------------------------------------


class StepProbe:
    """Records the phase times and buckets of every LLMEngine.step of one engine, through the
    engine's public step tracer (LLMEngine.set_step_tracer, jaxserve/runner/step_trace.py).

    finished_only: step(finished_only=True), as LLM.generate runs it (no RequestOutput per
    running request per step); False: every step's outputs, as a streaming caller gets them.
    """

    def __init__(self, engine, finished_only: bool = True) -> None:
        self.engine = engine
        self.finished_only = finished_only
        self.records: list[dict] = []
        self._cur: dict = {}
        engine.set_step_tracer(self._record)

    def uninstall(self) -> None:
        self.engine.set_step_tracer(None)

    def _record(self, trace) -> None:
        if not trace.padded_tokens:  # a step that ran no model
            return
        q, seq = trace.q_lens.astype(np.int64), trace.kv_lens.astype(np.int64)
        self._cur.update(
            schedule=trace.schedule_s,
            execute=trace.execute_s,
            update=trace.update_s,
            dispatch=trace.dispatch_s,
            device=trace.device_s,
            T=trace.padded_tokens,
            R=trace.padded_rows,
            B=trace.table_width,
            tokens=trace.num_tokens,
            rows=trace.num_rows,
            decode_rows=int((q == 1).sum()),
            # Context positions attention really needs: token i of a row of q new tokens and
            # length L sees L - q + i + 1 positions.
            ctx=int((q * (2 * seq - q + 1) // 2).sum()),
            attn_read=self._attention_reads(trace),
            all_greedy=trace.all_greedy,
        )

    def _attention_reads(self, trace) -> int:
        """Context positions the step's attention backend scores, summed over query rows:
        reference: every row, the whole bucketed width B x P; xla and cpu: see
        xla_scored_positions; others: as needed (reported as the needed count, via a negative
        marker resolved by the caller)."""
        backend = self.engine.info.plan.attention.name
        bs = self.engine.runner.block_size
        if backend == "reference":
            return trace.padded_tokens * trace.table_width * bs
        if backend in ("xla", "cpu"):
            return xla_scored_positions(
                trace.q_lens, trace.kv_lens, bs, trace.table_width, cpu_rows=backend == "cpu"
            )
        return -1

    def step(self) -> list:
        self._cur = {}
        t0 = time.perf_counter()
        outs = self.engine.step(finished_only=self.finished_only)
        self._cur["total"] = time.perf_counter() - t0
        if "T" in self._cur:
            self.records.append(self._cur)
        return outs


def xla_scored_positions(
    q_lens, kv_lens, page_size: int, table_width: int, cpu_rows: bool = False
) -> int:
    """Context positions the xla backend scores (default tunables), summed over query rows:
    decode rows, sorted by context and blocked, score up to their block's longest context
    rounded up to a chunk (with cpu_rows, the C++ kernel: their own context rounded up to a
    page); a tile of prefill rows scores up to its last row's context rounded up to a chunk,
    for every row of the tile."""
    from jaxserve.pallas_kernels.ragged_paged_attention import chunked

    q_lens, kv_lens = np.asarray(q_lens, np.int64), np.asarray(kv_lens, np.int64)
    row_chunk = chunked.chunk_pages(chunked.ROW_CHUNK_POSITIONS, page_size, table_width)
    tile_chunk = chunked.chunk_pages(chunked.TILE_CHUNK_POSITIONS, page_size, table_width)
    row_chunk, tile_chunk = row_chunk * page_size, tile_chunk * page_size
    decodes = np.sort(kv_lens[q_lens == 1])[::-1]
    if cpu_rows:
        total = int((-(-decodes // page_size) * page_size).sum())
    else:
        block_longest = np.repeat(decodes[:: chunked.ROWS_PER_BLOCK], chunked.ROWS_PER_BLOCK)
        total = int((-(-block_longest[: decodes.size] // row_chunk) * row_chunk).sum())
    tq = chunked.TILE_ROWS
    for q, kv in zip(q_lens[q_lens > 1], kv_lens[q_lens > 1], strict=True):
        for start in range(0, int(q), tq):
            rows = min(tq, int(q) - start)
            end = int(kv) - int(q) + start + rows  # context end of the tile's last row
            total += rows * (-(-end // tile_chunk) * tile_chunk)
    return total


def summarize_steps(records: list[dict], shape: ModelShape) -> dict:
    """Means per step (ms), padding ratios and useful model FLOP/s over the recorded steps
    (FLOPs as bench/_metrics.py counts them: 2 x layer params per real token, 2 x D x V per
    real row, causal attention over each real token's own context)."""
    if not records:
        return {}

    def mean(key: str) -> float:
        return float(np.mean([r.get(key, 0.0) for r in records])) * 1e3

    total, device = mean("total"), mean("device")
    prepare = mean("execute") - device  # execute_model minus the step: inputs + collect
    engine_out = total - mean("schedule") - mean("execute") - mean("update")
    sum_ = lambda k: float(sum(r[k] for r in records))  # noqa: E731
    attn_read = sum(r["attn_read"] if r["attn_read"] >= 0 else r["ctx"] for r in records)
    attn_flops = 4.0 * shape.num_layers * shape.num_heads * shape.head_dim
    flops = sum(
        2.0 * shape.layer_matmul_params * r["tokens"]
        + 2.0 * shape.lm_head_params * r["rows"]
        + attn_flops * r["ctx"]
        for r in records
    )
    return {
        "num_steps": len(records),
        "total_ms": total,
        "device_ms": device,
        "dispatch_ms": mean("dispatch"),
        "host_ms": total - device,
        "host_share": (total - device) / total,
        "schedule_ms": mean("schedule"),
        "prepare_and_collect_ms": prepare,
        "update_ms": mean("update"),
        "engine_output_ms": engine_out,
        "mean_real_tokens": sum_("tokens") / len(records),
        "mean_padded_tokens": sum_("T") / len(records),
        "mean_rows": sum_("rows") / len(records),
        "token_padding_waste": sum_("T") / sum_("tokens") - 1.0,
        "row_padding_waste": sum_("R") / sum_("rows") - 1.0,
        "attention_reads_per_needed": attn_read / max(sum_("ctx"), 1.0),
        "model_flops_per_s": flops / sum_("total"),
        "bucket_histogram": _histogram(records),
    }


def _histogram(records: list[dict]) -> dict:
    """Per bucket: steps, mean device ms, share of all device time, mean real tokens."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(f"T{r['T']}/R{r['R']}/B{r['B']}", []).append(r)
    total = sum(r["device"] for r in records) or 1.0
    out = {
        key: {
            "steps": len(rs),
            "device_ms": 1e3 * sum(r["device"] for r in rs) / len(rs),
            "device_share": sum(r["device"] for r in rs) / total,
            "mean_real_tokens": sum(r["tokens"] for r in rs) / len(rs),
        }
        for key, rs in groups.items()
    }
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["device_share"]))


# ---- parts ----------------------------------------------------------------------------------


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


def profile_run(
    engine,
    requests,
    *,
    name: str,
    shape: ModelShape,
    max_steps=None,
    skip_until_all_decode: bool = False,
    profile_host: bool = False,
    finished_only: bool = True,
    matmul_n: int = 2048,
) -> dict:
    """Offline run of `requests` with every step instrumented (optionally a window only)."""
    from jaxserve import SamplingParams

    _jaxserve_runs.reset_scheduler(engine, True)
    probe = StepProbe(engine, finished_only)
    for i, req in enumerate(requests):
        params = SamplingParams(max_tokens=req.output_len, temperature=1.0, ignore_eos=True, seed=i)
        engine.add_request(f"{name}-{i}", req.prompt_token_ids, params)
    compiles = _jaxserve_runs.compiles(engine)
    n = len(requests)
    if skip_until_all_decode:  # run the prefill phase uninstrumented-in-summary
        while True:
            probe.step()
            rec = probe.records[-1]
            if rec["rows"] == n and rec["decode_rows"] == n:
                break
        probe.records.clear()
    local_peak = machine_limits(matmul_n, copy_mib=1, reps=2)["matmul_flops_per_s"]
    prof = cProfile.Profile() if profile_host else None
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests() and (max_steps is None or steps < max_steps):
        if prof:
            prof.enable()
        probe.step()
        if prof:
            prof.disable()
        steps += 1
    elapsed = time.perf_counter() - t0
    if engine.has_unfinished_requests():
        engine.abort_request([f"{name}-{i}" for i in range(n)])
    probe.uninstall()
    out = summarize_steps(probe.records, shape)
    out["local_matmul_flops_per_s"] = local_peak
    out["mfu_vs_local_matmul"] = out["model_flops_per_s"] / local_peak
    during_run = _jaxserve_runs.compiles(engine) - compiles
    out.update(elapsed_s=elapsed, compilations_during_run=during_run)
    if prof:
        out["host_profile_top"] = _top_functions(prof, 18)
    return out


def _top_functions(prof: cProfile.Profile, n: int) -> list[dict]:
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, func), (_cc, calls, tottime, cumtime, _) in stats.stats.items():
        rows.append(
            {
                "function": f"{Path(file).name}:{line}:{func}",
                "calls": calls,
                "tottime_s": tottime,
                "cumtime_s": cumtime,
            }
        )
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[:n]


def print_summary(title: str, s: dict) -> None:
    print(
        f"\n{title}: {s['num_steps']} steps, {s['total_ms']:.1f} ms/step "
        f"(device {s['device_ms']:.1f}, host {s['host_ms']:.1f} = {s['host_share']:.1%}); "
        f"{s['model_flops_per_s'] / 1e9:.1f} useful GFLOP/s = {s['mfu_vs_local_matmul']:.0%} "
        "of a matmul timed just before"
    )
    print(
        f"  host per step: schedule {s['schedule_ms']:.2f} ms, prepare+collect "
        f"{s['prepare_and_collect_ms']:.2f} ms, update {s['update_ms']:.2f} ms, engine outputs "
        f"{s['engine_output_ms']:.2f} ms; the step call itself returned after "
        f"{s['dispatch_ms']:.2f} of the device ms (CPU: dispatch is not fully asynchronous)"
    )
    print(
        f"  tokens/step real {s['mean_real_tokens']:.0f} padded {s['mean_padded_tokens']:.0f} "
        f"(waste {s['token_padding_waste']:.1%}), rows {s['mean_rows']:.0f} (row waste "
        f"{s['row_padding_waste']:.1%}); attention reads {s['attention_reads_per_needed']:.1f}x "
        f"the context positions needed"
    )
    for k, v in list(s["bucket_histogram"].items())[:6]:
        print(
            f"    bucket {k:18s} {v['steps']:5d} steps, {v['device_ms']:7.1f} ms device, "
            f"{v['device_share']:5.1%} of device time, {v['mean_real_tokens']:6.1f} real tokens"
        )
    for r in s.get("host_profile_top", [])[:12]:
        print(
            f"    {r['tottime_s'] * 1e3 / s['num_steps']:7.2f} ms/step own  "
            f"{r['calls']:7d} calls  {r['function']}"
        )


def profile_goals(report: dict, concurrency: int) -> list[dict]:
    """The issue's per-step goals that this profile measures."""
    goals = []
    dec = report.get("decode")
    if dec:
        goals.append(
            {
                "goal": f"host time per step <= 5% at {concurrency} running",
                "measured": dec["host_share"],
                "holds": dec["host_share"] <= 0.05,
            }
        )
        goals.append(
            {
                "goal": f"useful FLOP/s >= 50% of matmul at {concurrency} running",
                "measured": dec["mfu_vs_local_matmul"],
                "holds": dec["mfu_vs_local_matmul"] >= 0.5,
            }
        )
    runs = [report[k] for k in ("sharegpt", "decode") if k in report]
    if runs:
        n = sum(r["compilations_during_run"] for r in runs)
        goals.append({"goal": "compilations after warm-up == 0", "measured": n, "holds": n == 0})
    return goals


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(throughput.PRESETS), default="default")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--num-requests", type=int, default=None, help="sharegpt part")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--parts", default="steps,attention,sharegpt,decode")
    p.add_argument(
        "--every-step-outputs",
        action="store_true",
        help="engine.step() returns every running request's output each step (a streaming "
        "caller's host cost); default: finished ones only, as LLM.generate runs",
    )
    p.add_argument("--cache", default=str(throughput.CACHE))
    p.add_argument("--output", default=str(throughput.RESULTS / "throughput_profile.json"))
    return p.parse_args(argv)


def _step_shapes(buckets, max_ctx: int, concurrency: int) -> list[tuple[int, int]]:
    """(T, context) of the "steps" part's synthetic batches, each once, in order."""
    t_max = buckets.token_buckets[-1]
    decode_t = buckets.padded_tokens(min(concurrency, t_max))
    contexts = sorted({c for c in (1, 128, 256, 512, 1024, max_ctx) if c <= max_ctx})
    shapes = [(decode_t, c) for c in contexts]  # decode at high concurrency
    shapes += [(t_max, c) for c in contexts[:2]]  # a full prefill budget
    # A small batch (the tail of an offline run): few tokens, short and long contexts.
    small = sorted({buckets.padded_tokens(min(t, t_max)) for t in (4, 8, 16)})
    shapes += [(t, c) for t in small for c in (contexts[1], max_ctx)]
    return list(dict.fromkeys(shapes))  # each once, in order


def _attention_cases(buckets, max_model_len: int, concurrency: int) -> list[tuple[int, int]]:
    """(T, context) of the "attention" part's cases."""
    t_max = buckets.token_buckets[-1]
    decode_t = buckets.padded_tokens(min(concurrency, t_max))
    contexts = [c for c in (32, 128, 512, 2048) if c <= max_model_len]
    cases = [(decode_t, c) for c in contexts]
    # The tail of an offline run: few tokens, long contexts.
    small = sorted({buckets.padded_tokens(min(t, t_max)) for t in (4, 16)})
    cases += [(t, c) for t in small for c in contexts[-2:]]
    cases += [(t_max, c) for c in contexts[1:3]]
    return cases


def _profile_sharegpt(engine, preset, settings, shape: ModelShape, args, matmul_n: int) -> dict:
    """The "sharegpt" part: the preset's ShareGPT-like offline run, profiled; prints it."""
    n = args.num_requests or preset.num_requests
    ds = _datasets.build(
        "sharegpt", n, shape.vocab, settings.block_size, **preset.dataset_kw.get("sharegpt", {})
    )
    s = profile_run(
        engine,
        ds.requests,
        name="profile-sharegpt",
        shape=shape,
        finished_only=not args.every_step_outputs,
        matmul_n=matmul_n,
    )
    print_summary(f"sharegpt ({n} requests, offline)", s)
    return s


def _profile_decode(engine, settings, shape: ModelShape, args, matmul_n: int) -> dict:
    """The "decode" part: --concurrency requests decoding together, --decode-steps steps
    profiled; prints it. SystemExit when --concurrency exceeds max_num_seqs."""
    c = args.concurrency
    if c > settings.max_num_seqs:
        raise SystemExit(f"--concurrency {c} exceeds max_num_seqs={settings.max_num_seqs}")
    ds = _datasets.random_fixed(
        c,
        shape.vocab,
        input_len=min(128, settings.max_model_len // 4),
        output_len=min(args.decode_steps + 64, settings.max_model_len * 3 // 4 - 1),
        seed=1,
    )
    s = profile_run(
        engine,
        ds.requests,
        name="profile-decode",
        shape=shape,
        max_steps=args.decode_steps,
        skip_until_all_decode=True,
        profile_host=True,
        finished_only=not args.every_step_outputs,
        matmul_n=matmul_n,
    )
    print_summary(f"decode at {c} running requests", s)
    return s


def main(argv: list[str] | None = None) -> dict:
    apply_cpu_workarounds()  # before jax starts: it runs jax before building an engine
    args = _parse_args(argv)
    parts = args.parts.split(",")
    preset = throughput.PRESETS[args.preset]
    throughput.enable_compile_cache(Path(args.cache) / "jax")
    model_dir = throughput.ensure_checkpoint(preset, Path(args.cache))
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    settings = _jaxserve_runs.EngineSettings(model=str(model_dir), **preset.engine)
    report: dict = {
        "preset": args.preset,
        "step_outputs": "every step" if args.every_step_outputs else "finished only",
        "loadavg_start": os.getloadavg(),
        "model": {"name": preset.model_name, "num_params": shape.num_params},
    }
    report["machine_limits"] = limits = machine_limits(**preset.limits)
    print(
        f"matmul {limits['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, copy "
        f"{limits['copy_bytes_per_s'] / 1e9:.1f} GB/s; load {os.getloadavg()}",
        flush=True,
    )
    engine, warm_s, warm_compiles = _jaxserve_runs.build_engine(settings)
    report["warmup"] = {"seconds": warm_s, "compilations": warm_compiles}
    buckets = engine.runner.buckets
    if "steps" in parts:
        print("\nstep alone (synthetic batches, every row at the given context):", flush=True)
        shapes = _step_shapes(buckets, settings.max_model_len, args.concurrency)
        report["steps"] = step_microbench(engine, shape, limits, shapes, args.reps)
    if "attention" in parts:
        print("\nattention alone (one layer's op x layers):", flush=True)
        cases = _attention_cases(buckets, settings.max_model_len, args.concurrency)
        report["attention"] = attention_microbench(engine, shape, cases, args.reps)
    if "sharegpt" in parts:
        report["sharegpt"] = _profile_sharegpt(
            engine, preset, settings, shape, args, limits["matmul_n"]
        )
    if "decode" in parts:
        report["decode"] = _profile_decode(engine, settings, shape, args, limits["matmul_n"])
    report["loadavg_end"] = os.getloadavg()
    report["goals"] = profile_goals(report, args.concurrency)
    for g in report["goals"]:
        print(f"  [{'OK  ' if g['holds'] else 'MISS'}] {g['goal']}: measured {g['measured']:.3g}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
