"""bench/attention_kernel.py's cases: the implementation the registry selects per case, timed on
its batch and compared with the reference (computed once per case); a failure is an error row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from _attention_kernel_presets import MAX_ERROR_CHARS, TOLERANCE, Preset
from _attention_kernel_recorder import Recorder
from _attention_kernel_timing import make_batch, time_op

from jaxserve.pallas_kernels.ragged_paged_attention import (
    AttentionImpl,
    Target,
    default_gpu_config,
    device_facts,
    select_attention,
)


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
