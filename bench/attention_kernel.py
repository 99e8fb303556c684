"""Benchmark of ragged paged attention: every implementation the registry runs here, side by side.

Decode: batch x context grid (one query token per sequence), at each of the preset's page sizes;
prefill: chunked-prefill and mixed batches. Each implementation (--backends: registry names,
resolved by ``select_attention`` for this device, the preset's shapes and the case's page size)
is timed on every case; a case reports the kernel's time, the K/V bytes it must read divided by
that time (achieved bytes/s) against a device-to-device copy bandwidth measured in the same run,
and the speedup over (and the max abs difference from) the jnp reference on the same batch.
An implementation the registry refuses here, or that fails to compile or run, is an error row;
the other rows are still measured. Prints a table and writes JSON (--out, rewritten after every
row, so a run cut short by a time limit keeps what it measured).

    python bench/attention_kernel.py --preset h200-decode --out a.json   # the GPU check (< 1 min)
    python bench/attention_kernel.py --preset h200 --out attention.json  # the full GPU sweep
    python bench/attention_kernel.py --preset cpu-smoke --out /tmp/a.json    # seconds, on CPU
    python bench/attention_kernel.py --backends xla,pallas_triton --page-sizes 16,32

Default backends: on GPU xla (the baseline), pallas_triton, pallas_mosaic_gpu (in that order:
a kernel that hangs is cut off by the caller's time limit after the others' rows are written);
on TPU xla, pallas_tpu; on CPU xla and pallas_triton (in Pallas interpret mode). "auto" names
the engine's own choice. On GPU and TPU an implementation that would only run in interpret mode
is an error row, not a measurement.

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
    AttentionImpl,
    Target,
    default_gpu_config,
    device_facts,
    select_attention,
)


@dataclasses.dataclass(frozen=True)
class Preset:
    batches: tuple[int, ...]  # decode batch sizes
    contexts: tuple[int, ...]  # decode context lengths
    prefills: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]  # (name, ((q_len, kv_len), ...))
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int  # of the prefill cases, and of the decode cases when page_sizes is empty
    dtype: str
    copy_bytes: int  # size of the copy probes
    inner: int  # op calls per timed program
    repeats: int  # timed programs per case (median reported)
    memory_fraction: float = 0.7  # of device memory a case may use
    page_sizes: tuple[int, ...] = ()  # decode page sizes (empty: page_size)
    kv_split_variants: bool = False  # Triton decode rows again without KV splits

    @property
    def decode_page_sizes(self) -> tuple[int, ...]:
        return self.page_sizes or (self.page_size,)


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
        kv_split_variants=True,
    ),
    # bench/gpu_check.sh's stage: decode of 64 sequences x 4096 tokens (Llama-3-8B's attention
    # shapes), page sizes 16 and 32, every GPU implementation; well under a minute.
    "h200-decode": Preset(
        batches=(64,),
        contexts=(4096,),
        prefills=(),
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        page_sizes=(16, 32),
        dtype="bfloat16",
        copy_bytes=2 << 30,
        inner=10,
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

DEFAULT_BACKENDS = {
    "gpu": ("xla", "pallas_triton", "pallas_mosaic_gpu"),
    "tpu": ("xla", "pallas_tpu"),
    "cpu": ("xla", "pallas_triton"),
}
# A kernel whose output differs from the reference by more than this (outputs are O(1)) is
# flagged in its row ("mismatch"): the numbers of a wrong kernel mean nothing.
TOLERANCE = {"float32": 2e-3, "bfloat16": 6e-2, "float16": 1e-2}
MAX_ERROR_CHARS = 600  # of an error message kept in a row


def make_batch(
    preset: Preset, seqs: list[tuple[int, int]], seed: int = 0, page_size: int | None = None
) -> tuple:
    """Device arrays (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs) for the
    sequences (q_len, kv_len), on randomly permuted pages (page 0 is the null page)."""
    page = page_size or preset.page_size
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


def _best_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and first touch
    best = math.inf
    for _ in range(max(3, repeats)):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(preset: Preset) -> float:
    """Streaming bytes/s (read + write) of an elementwise op over a copy_bytes array."""
    return copy_bandwidths(preset)["elementwise"]


def copy_bandwidths(preset: Preset) -> dict[str, float]:
    """Device-to-device bytes/s (read + write) over a copy_bytes array, two ways: an
    elementwise op (XLA's streaming loop) and a plain device copy (jax.device_put with
    may_alias=False: a memcpy on GPU), when this jax has it."""
    x = jnp.ones((preset.copy_bytes // 2,), jnp.bfloat16)
    step = jax.jit(lambda y: y * jnp.bfloat16(1.0001))
    out = {"elementwise": 2 * preset.copy_bytes / _best_seconds(lambda: step(x), preset.repeats)}
    try:
        memcpy = functools.partial(jax.device_put, x, x.sharding, may_alias=False)
        out["memcpy"] = 2 * preset.copy_bytes / _best_seconds(memcpy, preset.repeats)
    except TypeError:  # a jax without device_put(may_alias=...)
        pass
    return out


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


def target_for(preset: Preset, page_size: int, device: jax.Device | None = None) -> Target:
    """The registry's Target for the preset's attention shapes on ``device`` (default: jax's
    first device)."""
    facts = device_facts(device or jax.devices()[0])
    return Target(
        dtype=preset.dtype,
        num_q_heads=preset.num_q_heads,
        num_kv_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        page_size=page_size,
        **facts,
    )


def select_backend(name: str, target: Target) -> AttentionImpl:
    """The implementation the registry gives ``name`` ("auto" or a registry name) for
    ``target``.

    Raises:
        ValueError: the registry refuses it here (its message says why and lists those that
            can), or, off the CPU, it would only run in Pallas interpret mode.
    """
    impl, _ = select_attention(name, target)
    if impl.interpret and target.platform != "cpu":
        raise ValueError(
            f"{name} would run {impl.name} in Pallas interpret mode on {target.platform}: "
            "nothing to benchmark"
        )
    return impl


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


class References:
    """The reference's time and output per case, computed once and shared by the backends."""

    def __init__(self, preset: Preset) -> None:
        self.preset = preset
        self._done: dict[tuple, tuple[float, jax.Array] | None] = {}

    def get(self, key: tuple, args: tuple, seqs: list[tuple[int, int]], page_size: int):
        """(seconds per call, output), or None when it does not fit or fails."""
        if key not in self._done:
            self._done[key] = self._run(args, seqs, page_size)
        return self._done[key]

    def _run(self, args: tuple, seqs: list[tuple[int, int]], page_size: int):
        preset = self.preset
        kv_bytes = _kv_bytes(preset, seqs, page_size)
        width_tokens = max(-(-kv // page_size) for _, kv in seqs) * page_size
        if not _fits(2 * kv_bytes + _reference_bytes(preset, seqs, width_tokens), preset):
            return None
        reference = select_attention("reference", target_for(preset, page_size))[0]
        op = functools.partial(reference, sm_scale=preset.head_dim**-0.5)
        try:
            return time_op(op, args, max(1, preset.inner // 4), preset.repeats)
        except Exception as e:  # noqa: BLE001 - recorded by the caller as a missing reference
            print(f"reference failed: {_error_text(e)}", flush=True)
            return None


def _kv_bytes(preset: Preset, seqs: list[tuple[int, int]], page_size: int) -> int:
    """K/V bytes a kernel must read: every page of every sequence's context."""
    itemsize = jnp.dtype(preset.dtype).itemsize
    kv_tokens = sum(-(-kv // page_size) * page_size for _, kv in seqs)
    return 2 * kv_tokens * preset.num_kv_heads * preset.head_dim * itemsize


def run_case(
    preset: Preset,
    seqs: list[tuple[int, int]],
    impl: AttentionImpl,
    page_size: int,
    references: References | None,
    kernel_options: dict | None = None,
) -> dict:
    """Time ``impl`` on one batch (and compare it with the reference); a failure to compile or
    run becomes the row's "error"."""
    kv_bytes = _kv_bytes(preset, seqs, page_size)
    row = dict(num_seqs=len(seqs), num_tokens=sum(q for q, _ in seqs), kv_bytes=kv_bytes)
    if not _fits(2 * kv_bytes, preset):
        return dict(row, skipped="does not fit device memory")
    scale = preset.head_dim**-0.5
    try:
        args = make_batch(preset, seqs, page_size=page_size)
        if kernel_options:
            kernel = functools.partial(_triton_with, options=kernel_options, sm_scale=scale)
        else:
            kernel = functools.partial(impl, sm_scale=scale)
        row["kernel_s"], got = time_op(kernel, args, preset.inner, preset.repeats)
    except Exception as e:  # noqa: BLE001 - a kernel that fails here is a result, not a crash
        return dict(row, error=_error_text(e), error_stage="compile or run")
    row["achieved_Bps"] = kv_bytes / row["kernel_s"]
    key = (page_size, tuple(seqs))
    ref = references.get(key, args, seqs, page_size) if references else None
    if ref is not None:
        row["reference_s"], want = ref
        row["speedup"] = row["reference_s"] / row["kernel_s"]
        err = jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max()
        row["max_abs_err"] = float(err)  # sanity check of the kernel at benchmark scale
        if not row["max_abs_err"] <= TOLERANCE[preset.dtype]:
            row["mismatch"] = True
    return row


def _triton_with(*args, options: dict, sm_scale: float):
    """The Triton kernel with explicit options (the "no KV split" variant rows)."""
    from jaxserve.pallas_kernels.ragged_paged_attention import ragged_paged_attention_gpu

    interpret = device_facts(jax.devices()[0])["platform"] != "gpu"
    return ragged_paged_attention_gpu(*args, sm_scale=sm_scale, interpret=interpret, **options)


def _kernel_config(impl: AttentionImpl, preset: Preset, batch: int, context: int, page: int):
    """The GPU kernel's default config for a decode batch (for the row), or None."""
    shapes = (
        (batch, preset.num_q_heads, preset.head_dim),
        (preset.num_kv_heads, 1, page, preset.head_dim),
        (batch, -(-context // page)),
    )
    cores = {} if impl.num_cores is None else {"num_cores": impl.num_cores}
    try:
        if impl.kernel == "triton":
            return default_gpu_config(*shapes, **cores)
        if impl.kernel == "mosaic_gpu":
            from jaxserve.pallas_kernels.ragged_paged_attention import mosaic_gpu

            return mosaic_gpu.default_mosaic_gpu_config(*shapes, **cores)
    except Exception:  # noqa: BLE001 - metadata only: a kernel module in flux must not matter
        return None
    return None


class Recorder:
    """Prints each result row and rewrites the JSON after it, so a run cut short by a time
    limit still leaves every row measured so far."""

    def __init__(self, header: dict, out: str | None, copies: dict[str, float]) -> None:
        # The faster probe is the device's copy bandwidth; a "memcpy" over twice the
        # elementwise stream would be a copy that did not happen (an alias), not a bandwidth.
        copy_bps = copies["elementwise"]
        if copies.get("memcpy", 0.0) <= 2 * copy_bps:
            copy_bps = max(copy_bps, copies.get("memcpy", 0.0))
        self.result = dict(
            header,
            copy_Bps=copy_bps,
            copy_elementwise_Bps=copies["elementwise"],
            copy_memcpy_Bps=copies.get("memcpy"),
            complete=False,
            cases=[],
        )
        self.out = out
        self.copy_bps = copy_bps
        probes = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in copies.items())
        print(f"device-to-device copy: {copy_bps / 1e9:.1f} GB/s (read + write; {probes})")
        print(_HEADER)

    def add(self, row: dict) -> None:
        if "achieved_Bps" in row:
            row["fraction_of_copy"] = row["achieved_Bps"] / self.copy_bps
        self.result["cases"].append(row)
        print(_format_row(row, self.copy_bps), flush=True)
        self.save()

    def finish(self) -> dict:
        self.result["summary"] = summarize(self.result["cases"])
        self.result["complete"] = True
        self.save()
        return self.result

    def save(self) -> None:
        if self.out:
            with open(self.out, "w") as f:
                json.dump(self.result, f, indent=1)


def summarize(cases: list[dict]) -> dict:
    """Per backend: its decode rows' best achieved bytes/s and fraction of the copy, per page
    size, and its error count."""
    out: dict[str, dict] = {}
    for row in cases:
        entry = out.setdefault(row["backend"], {"impl": row.get("impl"), "errors": 0, "decode": {}})
        if "error" in row:
            entry["errors"] += 1
        elif row["kind"] == "decode" and "achieved_Bps" in row:
            best = entry["decode"].setdefault(str(row["page_size"]), {"achieved_Bps": 0.0})
            if row["achieved_Bps"] > best["achieved_Bps"]:
                best.update(
                    achieved_Bps=row["achieved_Bps"],
                    fraction_of_copy=row["fraction_of_copy"],
                    batch=row["batch"],
                    context=row["context"],
                )
    return out


def backend_cases(preset: Preset, name: str, recorder: Recorder, references: References) -> None:
    """Every case of the preset with the implementation ``name`` selects per page size."""
    cases = [
        ("decode", page, batch, context, [(1, context)] * batch)
        for page in preset.decode_page_sizes
        for batch in preset.batches
        for context in preset.contexts
    ]
    cases += [
        (kind, preset.page_size, len(seqs), max(kv for _, kv in seqs), list(seqs))
        for kind, seqs in preset.prefills
    ]
    for kind, page, batch, context, seqs in cases:
        head = dict(kind=kind, backend=name, page_size=page, batch=batch, context=context)
        try:
            impl = select_backend(name, target_for(preset, page))
        except ValueError as e:
            recorder.add(dict(head, error=_error_text(e), error_stage="select"))
            continue
        head.update(impl=impl.name, interpret=impl.interpret)
        if kind == "decode":
            config = _kernel_config(impl, preset, batch, context, page)
            if config is not None:
                head["gpu_config"] = dataclasses.asdict(config)
        row = dict(head, **run_case(preset, seqs, impl, page, references))
        recorder.add(row)
        splits = head.get("gpu_config", {}).get("num_kv_splits", 1)
        if (
            preset.kv_split_variants
            and impl.kernel == "triton"
            and splits > 1
            and "kernel_s" in row
        ):
            unsplit = run_case(preset, seqs, impl, page, None, dict(num_kv_splits=1))
            recorder.add(dict(head, kind="decode, no KV split", **unsplit))


_HEADER = (
    f"{'case':30} {'backend':18} {'P':>3} {'batch':>5} {'context':>7} {'kernel us':>10} "
    f"{'GB/s':>8} {'%copy':>6} {'ref us':>10} {'speedup':>8} {'max err':>8}"
)


def _format_row(row: dict, copy_bps: float) -> str:
    head = (
        f"{row['kind']:30} {row['backend']:18} {row['page_size']:>3} {row['batch']:>5} "
        f"{row['context']:>7}"
    )
    if "skipped" in row:
        return f"{head}  skipped: {row['skipped']}"
    if "error" in row:
        return f"{head}  ERROR ({row['error_stage']}): {row['error'][:200]}"
    ref = row.get("reference_s", math.nan)
    flag = "  MISMATCH" if row.get("mismatch") else ""
    return (
        f"{head} {row['kernel_s'] * 1e6:>10.1f} {row['achieved_Bps'] / 1e9:>8.1f} "
        f"{100 * row['achieved_Bps'] / copy_bps:>6.1f} {ref * 1e6:>10.1f} "
        f"{row.get('speedup', math.nan):>8.2f} {row.get('max_abs_err', math.nan):>8.1e}{flag}"
    )


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--out", default=None, help="JSON output path (rewritten after each row)")
    parser.add_argument(
        "--backends",
        default=None,
        help="comma-separated registry names (or 'auto'); default: every kernel of this "
        "platform and xla (GPU: xla,pallas_triton,pallas_mosaic_gpu)",
    )
    parser.add_argument(
        "--page-sizes", default=None, help="decode page sizes, e.g. 16,32 (default: the preset's)"
    )
    opts = parser.parse_args(argv)
    preset = PRESETS[opts.preset]
    if opts.page_sizes:
        preset = dataclasses.replace(preset, page_sizes=_int_list(opts.page_sizes))
    device = jax.devices()[0]
    platform = device_facts(device)["platform"]
    if opts.backends:
        backends = tuple(b.strip() for b in opts.backends.split(",") if b.strip())
    else:
        backends = DEFAULT_BACKENDS[platform]
    print(
        f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"backends: {', '.join(backends)}"
    )
    header = dict(
        preset=opts.preset,
        device=device.device_kind,
        platform=jax.default_backend(),
        jax_version=jax.__version__,
        # The Pallas kernel family of this platform, and whether it is interpreted here (the
        # fields of the single-kernel version of this benchmark).
        kernel="tpu" if platform == "tpu" else "gpu",
        interpret=platform == "cpu",
        backends=list(backends),
        config=dataclasses.asdict(preset),
    )
    recorder = Recorder(header, opts.out, copy_bandwidths(preset))
    references = References(preset)
    for name in backends:
        backend_cases(preset, name, recorder, references)
    result = recorder.finish()
    if opts.out:
        print(f"wrote {opts.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
