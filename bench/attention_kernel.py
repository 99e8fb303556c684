"""Benchmark of ragged paged attention: the Pallas kernel against the jnp reference.

Decode: batch x context grid (one query token per sequence); prefill: chunked-prefill and
mixed batches. For each case it reports the kernel's time, the K/V bytes it must read divided by
that time (achieved bytes/s) against a streaming-copy bandwidth measured in the same run, and the
speedup over the reference. Prints a table and writes JSON (--out).

    python bench/attention_kernel.py --preset h200 --out attention.json      # on a GPU
    python bench/attention_kernel.py --preset cpu-smoke --out /tmp/a.json    # seconds, on CPU

Each timed program runs the op `inner` times back to back inside one jit (each call's input
depends on the previous output, so nothing is hoisted or overlapped), which keeps Python
dispatch out of the per-call time, as in a model step.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pallas_kernels.ragged_paged_attention import (
    default_gpu_config,
    device_facts,
    ragged_paged_attention,
)


@dataclasses.dataclass(frozen=True)
class Preset:
    batches: tuple[int, ...]  # decode batch sizes
    contexts: tuple[int, ...]  # decode context lengths
    prefills: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]  # (name, ((q_len, kv_len), ...))
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    copy_bytes: int  # size of the streaming-copy probe
    inner: int  # op calls per timed program
    repeats: int  # timed programs per case (median reported)
    memory_fraction: float = 0.7  # of device memory a case may use


PRESETS = {
    "h200": Preset(
        batches=(1, 8, 64, 256),
        contexts=(512, 4096, 32768),
        prefills=(
            ("prefill 1x2048 fresh", ((2048, 2048),)),
            ("prefill 4x512 chunk @4k", ((512, 4096),) * 4),
            ("mixed 1x1024 + 63 decodes @4k", ((1024, 1024),) + ((1, 4096),) * 63),
        ),
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        dtype="bfloat16",
        copy_bytes=2 << 30,
        inner=20,
        repeats=5,
    ),
    "cpu-smoke": Preset(
        batches=(1, 4),
        contexts=(64,),
        prefills=(("mixed 1x16 + 3 decodes @48", ((16, 16),) + ((1, 48),) * 3),),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        dtype="float32",
        copy_bytes=8 << 20,
        inner=2,
        repeats=2,
    ),
}


def make_batch(preset: Preset, seqs: list[tuple[int, int]], seed: int = 0) -> tuple:
    """Device arrays (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs) for the
    sequences (q_len, kv_len), on randomly permuted pages (page 0 is the null page)."""
    page = preset.page_size
    width = max(-(-kv // page) for _, kv in seqs)
    num_pages = 1 + sum(-(-kv // page) for _, kv in seqs)
    rng = np.random.default_rng(seed)
    free = iter(rng.permutation(np.arange(1, num_pages)))
    tables = np.zeros((len(seqs), width), np.int32)
    for i, (_, kv) in enumerate(seqs):
        tables[i, : -(-kv // page)] = [next(free) for _ in range(-(-kv // page))]
    cu_q_lens = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    dtype = jnp.dtype(preset.dtype)
    keys = jax.random.split(jax.random.key(seed), 3)
    pool = (preset.num_kv_heads, num_pages, page, preset.head_dim)
    num_tokens = int(cu_q_lens[-1])
    return (
        jax.random.normal(keys[0], (num_tokens, preset.num_q_heads, preset.head_dim), dtype),
        jax.random.normal(keys[1], pool, dtype),
        jax.random.normal(keys[2], pool, dtype),
        jnp.asarray([kv for _, kv in seqs], jnp.int32),
        jnp.asarray(tables),
        jnp.asarray(cu_q_lens),
        jnp.asarray([len(seqs)], jnp.int32),
    )


def time_op(op, args: tuple, inner: int, repeats: int) -> tuple[float, jax.Array]:
    """(median seconds per op call, the op's output), `inner` dependent calls per program."""

    @jax.jit
    def chained(q, *rest):
        for _ in range(inner):
            out = op(q, *rest)
            # Serialise the calls: q depends on the last output, by an amount below q's precision
            # (so every call sees the same values), which XLA cannot know or fold away.
            tiny = out[:1, :1, :1].astype(jnp.float32) * 1e-30
            q = q + tiny.astype(q.dtype)
        return q, out

    jax.block_until_ready(chained(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _, out = jax.block_until_ready(chained(*args))
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times), out


def copy_bandwidth(preset: Preset) -> float:
    """Streaming bytes/s (read + write) of an elementwise op over a copy_bytes array."""
    x = jnp.ones((preset.copy_bytes // 2,), jnp.bfloat16)
    step = jax.jit(lambda y: y * jnp.bfloat16(1.0001))
    step(x).block_until_ready()
    times = []
    for _ in range(max(3, preset.repeats)):
        start = time.perf_counter()
        step(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * preset.copy_bytes / min(times)


def _device_memory() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def _fits(nbytes: int, preset: Preset) -> bool:
    limit = _device_memory()
    return limit is None or nbytes <= preset.memory_fraction * limit


def _reference_bytes(preset: Preset, seqs: list[tuple[int, int]], width_tokens: int) -> int:
    """Working set of the reference: K and V gathered in f32 for up to 256 query rows."""
    num_tokens = sum(q for q, _ in seqs)
    rows = 256 if num_tokens > 256 and num_tokens % 256 == 0 else num_tokens  # its chunking
    return 2 * rows * width_tokens * preset.num_kv_heads * preset.head_dim * 4


def run_case(
    preset: Preset, seqs: list[tuple[int, int]], kernel_options: dict, with_reference: bool = True
) -> dict:
    """Time the kernel (and the reference) on one batch; K/V bytes are those the kernel must
    read: every page of every sequence's context."""
    itemsize = jnp.dtype(preset.dtype).itemsize
    width_tokens = max(-(-kv // preset.page_size) for _, kv in seqs) * preset.page_size
    kv_tokens = sum(-(-kv // preset.page_size) * preset.page_size for _, kv in seqs)
    kv_bytes = 2 * kv_tokens * preset.num_kv_heads * preset.head_dim * itemsize
    row = dict(num_seqs=len(seqs), num_tokens=sum(q for q, _ in seqs), kv_bytes=kv_bytes)
    if not _fits(2 * kv_bytes, preset):
        return dict(row, skipped="does not fit device memory")
    args = make_batch(preset, seqs)
    scale = preset.head_dim**-0.5
    kernel = functools.partial(ragged_paged_attention, sm_scale=scale, backend="pallas")
    if kernel_options:
        kernel = functools.partial(_gpu_kernel_with, options=kernel_options, sm_scale=scale)
    row["kernel_s"], got = time_op(kernel, args, preset.inner, preset.repeats)
    row["achieved_Bps"] = kv_bytes / row["kernel_s"]
    ref_bytes = 2 * kv_bytes + _reference_bytes(preset, seqs, width_tokens)
    if with_reference and _fits(ref_bytes, preset):
        reference = functools.partial(ragged_paged_attention, sm_scale=scale, backend="reference")
        inner = max(1, preset.inner // 4)
        row["reference_s"], want = time_op(reference, args, inner, preset.repeats)
        row["speedup"] = row["reference_s"] / row["kernel_s"]
        err = jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max()
        row["max_abs_err"] = float(err)  # sanity check of the kernel at benchmark scale
    return row


def _gpu_kernel_with(*args, options: dict, sm_scale: float):
    from jaxserve.pallas_kernels.ragged_paged_attention import ragged_paged_attention_gpu

    interpret = device_facts(jax.devices()[0])["platform"] != "gpu"
    return ragged_paged_attention_gpu(*args, sm_scale=sm_scale, interpret=interpret, **options)


class Recorder:
    """Prints each result row and rewrites the JSON after it, so a run cut short by a time
    limit still leaves every row measured so far."""

    def __init__(self, header: dict, out: str | None, copy_bps: float) -> None:
        self.result = dict(header, copy_Bps=copy_bps, cases=[])
        self.out = out
        self.copy_bps = copy_bps
        print(f"streaming copy: {copy_bps / 1e9:.1f} GB/s (read + write)\n{_HEADER}")

    def add(self, row: dict) -> None:
        self.result["cases"].append(row)
        print(_format_row(row, self.copy_bps), flush=True)
        if self.out:
            with open(self.out, "w") as f:
                json.dump(self.result, f, indent=1)


def decode_cases(preset: Preset, kernel: str, recorder: Recorder) -> None:
    for batch in preset.batches:
        for context in preset.contexts:
            seqs = [(1, context)] * batch
            row = dict(kind="decode", batch=batch, context=context, **run_case(preset, seqs, {}))
            config = None
            if kernel == "gpu":
                config = default_gpu_config(
                    (batch, preset.num_q_heads, preset.head_dim),
                    (preset.num_kv_heads, 1, preset.page_size, preset.head_dim),
                    (batch, -(-context // preset.page_size)),
                )
                row["gpu_config"] = dataclasses.asdict(config)
            recorder.add(row)
            if config is not None and config.num_kv_splits > 1 and "skipped" not in row:
                unsplit = run_case(preset, seqs, dict(num_kv_splits=1), with_reference=False)
                recorder.add(
                    dict(kind="decode, no KV split", batch=batch, context=context, **unsplit)
                )


def prefill_cases(preset: Preset, recorder: Recorder) -> None:
    for name, seqs in preset.prefills:
        row = dict(kind=name, batch=len(seqs), context=max(kv for _, kv in seqs))
        recorder.add(dict(row, **run_case(preset, list(seqs), {})))


_HEADER = (
    f"{'case':34} {'batch':>5} {'context':>7} {'kernel us':>10} {'GB/s':>8} {'%copy':>6} "
    f"{'ref us':>10} {'speedup':>8} {'max err':>8}"
)


def _format_row(row: dict, copy_bps: float) -> str:
    head = f"{row['kind']:34} {row['batch']:>5} {row['context']:>7}"
    if "skipped" in row:
        return f"{head}  skipped: {row['skipped']}"
    ref = row.get("reference_s", math.nan)
    return (
        f"{head} {row['kernel_s'] * 1e6:>10.1f} {row['achieved_Bps'] / 1e9:>8.1f} "
        f"{100 * row['achieved_Bps'] / copy_bps:>6.1f} {ref * 1e6:>10.1f} "
        f"{row.get('speedup', math.nan):>8.2f} {row.get('max_abs_err', math.nan):>8.1e}"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--out", default=None, help="JSON output path (rewritten after each row)")
    opts = parser.parse_args(argv)
    preset = PRESETS[opts.preset]
    device = jax.devices()[0]
    platform = device_facts(device)["platform"]
    # "pallas" is the Triton kernel on GPU (and, interpreted, on CPU), Mosaic TPU on TPU.
    kernel, interpret = ("tpu", False) if platform == "tpu" else ("gpu", platform != "gpu")
    print(
        f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"kernel: {kernel}{' (interpret mode)' if interpret else ''}"
    )
    header = dict(
        preset=opts.preset,
        device=device.device_kind,
        platform=jax.default_backend(),
        jax_version=jax.__version__,
        kernel=kernel,
        interpret=interpret,
        config=dataclasses.asdict(preset),
    )
    recorder = Recorder(header, opts.out, copy_bandwidth(preset))
    decode_cases(preset, kernel, recorder)
    prefill_cases(preset, recorder)
    if opts.out:
        print(f"wrote {opts.out}")
    return recorder.result


if __name__ == "__main__":
    main(sys.argv[1:])
