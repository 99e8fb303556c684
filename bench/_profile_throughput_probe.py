"""bench/profile_throughput.py's step probe: the phase times and buckets of every engine step,
through the engine's public step tracer, and their summary (means per step, padding, FLOP/s).
"""

from __future__ import annotations

import time

import numpy as np
from _metrics import ModelShape


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
