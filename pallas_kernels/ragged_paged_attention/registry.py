"""The choice of a ragged paged attention implementation for a Target: the attention_backend
names, the order "auto" tries them in, and why each one cannot run.

The kernels themselves are data (kernels.py: each one's entry point, capabilities and options);
the chosen one is an ``AttentionImpl`` (impl.py), a small frozen object that models hold as
static configuration and call like a function, so nothing below the engine's execution plan
ever sees a backend name or asks which platform it runs on.

``select_attention`` picks one for a ``Target`` once: "auto" walks the platform's preference
order and records why each refused implementation was refused; an explicit name that cannot run
raises a ValueError that lists the ones that can.

    name                 kernel         natively on                 interpret mode (tests)
    "reference"          reference.py   any                         -
    "xla"                chunked.py     any                         -
    "cpu"                chunked.py + cpu_rows.cc (f32)  cpu        -
    "pallas_mosaic_gpu"  mosaic_gpu.py  GPU, Hopper (bf16 / f16)    any platform
    "pallas_triton"      gpu.py         GPU, Ampere and newer       any platform
    "pallas_tpu"         tpu.py         TPU                         any platform
    "pallas_gpu"         the GPU kernel of this GPU's generation (Mosaic GPU, else Triton)
    "pallas"             the platform's Pallas kernel (on CPU: the Triton kernel, interpreted)

An FP8 KV cache (kv_quant.py) is read by reference, xla, pallas_triton and pallas_tpu; the
C++ row kernel ("cpu", f32 pages only) and Mosaic GPU (WGMMA on bf16 / f16 SMEM tiles) are
refused for it, so "auto" takes xla on the CPU and Triton on Hopper. On GPUs below sm_89
(Target.converts_e4m3) the Triton kernel reads float8_e4m3fn pages as bytes and converts them
with integer ops (AttentionImpl.soft_fp8); float8_e5m2 it converts natively everywhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.ragged_paged_attention.impl import AttentionImpl, head_split_refusal
from jaxserve.pallas_kernels.ragged_paged_attention.kernels import KERNELS
from jaxserve.pallas_kernels.ragged_paged_attention.target import (
    AMPERE,
    BLACKWELL,
    FP8_KV_DTYPES,
    HOPPER,
    OLDER_GPU,
    Target,
)

# attention_backend names -> the kernels they may mean, in preference order.
NAMES: dict[str, tuple[str, ...]] = {
    **{spec.backend: (kernel,) for kernel, spec in KERNELS.items()},
    "pallas_gpu": ("mosaic_gpu", "triton"),
    "pallas": ("mosaic_gpu", "triton", "mosaic_tpu"),
}
BACKENDS = tuple(NAMES)
# What "auto" tries, in order, per platform (GPU: per generation). Never interpret mode.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cpu": ("cpu", "xla", "reference"),
    "tpu": ("pallas_tpu", "xla", "reference"),
    BLACKWELL: ("pallas_mosaic_gpu", "pallas_triton", "xla", "reference"),
    HOPPER: ("pallas_mosaic_gpu", "pallas_triton", "xla", "reference"),
    AMPERE: ("pallas_triton", "xla", "reference"),
    OLDER_GPU: ("pallas_triton", "xla", "reference"),  # tried so the log says why not
}


def refusal(name: str, kernel: str, target: Target, interpret: bool = False) -> str | None:
    """Why ``kernel`` (under the name ``name``) cannot run for ``target``, or None."""
    spec = KERNELS[kernel]
    where = target.where
    if interpret:  # a test path: on the CPU only, never instead of a chip's own kernel
        if not spec.interpretable or target.platform != "cpu":
            return f"{name} cannot run on {where}, natively or in interpret mode"
    elif target.platform not in spec.platforms:
        return f"{name} runs on {'/'.join(spec.platforms)}, not on {where}"
    elif target.platform == "gpu" and spec.gpu_generations:
        if target.gpu_generation not in spec.gpu_generations:
            return (
                f"{name} needs a {' or '.join(spec.gpu_generations)} GPU; {where} is "
                f"{target.gpu_generation}"
            )
    if target.dtype not in spec.dtypes:
        return f"{name} takes {'/'.join(spec.dtypes)}, not {target.dtype}"
    if target.kv_dtype in FP8_KV_DTYPES and not spec.fp8_kv:
        return f"{name} cannot read an FP8 KV cache ({target.kv_dtype} pages)"
    if target.sliding_window is not None and not spec.sliding_window:
        return f"{name} has no sliding window"
    if target.soft_cap is not None and not spec.soft_cap:
        return f"{name} has no soft cap"
    reason = spec.available()
    if reason is None and not interpret:
        reason = spec.target_refusal(target)
    if reason is not None:
        return f"{name}: {reason}"
    if target.tensor_parallel_size > 1 and spec.shard_map:
        reason = head_split_refusal(
            target.num_q_heads, target.num_kv_heads, target.tensor_parallel_size
        )
        if reason is not None:
            return f"{name}: {reason}"
    return _shape_refusal(name, AttentionImpl(name, kernel, interpret), target)


def _shape_refusal(name: str, impl: AttentionImpl, target: Target) -> str | None:
    """The kernel's own validation on the target's per-device shapes (traced, not run)."""
    tp = target.tensor_parallel_size if impl.spec.shard_map else 1
    n, k = target.num_q_heads, target.num_kv_heads
    if n % tp == 0 and k % tp == 0:
        n, k = n // tp, k // tp
    dtype = jnp.dtype(target.dtype)
    num_rows, width = 8, 4
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    pages = jax.ShapeDtypeStruct(
        (k, 16, target.page_size, target.head_dim), jnp.dtype(target.kv_dtype)
    )
    args = (
        jax.ShapeDtypeStruct((16, n, target.head_dim), dtype),
        pages,
        pages,
        i32((num_rows,)),
        i32((num_rows, width)),
        i32((num_rows + 1,)),
        i32((1,)),
    )
    options = dict(
        sm_scale=target.head_dim**-0.5,
        sliding_window=target.sliding_window,
        soft_cap=target.soft_cap,
    )
    try:
        jax.eval_shape(functools.partial(impl, **options), *args)
    except ValueError as e:
        return f"{name}: {e}"
    return None


def auto_order(target: Target) -> tuple[str, ...]:
    """What "auto" tries for ``target``, in order."""
    return AUTO_ORDER[target.gpu_generation if target.platform == "gpu" else target.platform]


def select_attention(
    requested: str, target: Target, *, order: tuple[str, ...] | None = None
) -> tuple[AttentionImpl, list[str]]:
    """The implementation for ``target``: ``requested`` is "auto" or a name of NAMES.

    Args:
        order: with "auto", the names to try instead of auto_order(target).

    Returns:
        (the implementation, why each implementation tried before it was refused).

    Raises:
        ValueError: an unknown name, or an explicit one that cannot run for the target; the
            message says why and lists the names that can.
    """
    if requested == "auto":
        refused = []
        for name in auto_order(target) if order is None else order:
            impl, reason = _resolve(name, target, allow_interpret=False)
            if impl is not None:
                return impl, refused
            refused.append(reason)
        raise ValueError(f"no attention implementation runs here: {'; '.join(refused)}")
    if requested not in NAMES:
        raise ValueError(
            f"attention_backend must be 'auto' or one of {BACKENDS}, got {requested!r}"
        )
    impl, reason = _resolve(requested, target, allow_interpret=True)
    if impl is None:
        raise ValueError(
            f"attention_backend={requested!r} cannot run here ({reason}); these can: "
            f"{runnable_names(target)}"
        )
    return impl, []


def runnable_names(target: Target) -> list[str]:
    """The attention_backend names that run natively for ``target``."""
    return [name for name in NAMES if _resolve(name, target, allow_interpret=False)[0]]


def _resolve(
    name: str, target: Target, *, allow_interpret: bool
) -> tuple[AttentionImpl | None, str]:
    """The first kernel ``name`` may mean that runs natively for ``target``; else, when
    allowed, the first that runs in interpret mode; else None and why the native ones cannot."""
    reasons = []
    for kernel in NAMES[name]:
        backend = KERNELS[kernel].backend
        reason = refusal(backend, kernel, target)
        if reason is None:
            soft_fp8 = target.kv_dtype == "float8_e4m3fn" and not target.converts_e4m3
            return AttentionImpl(backend, kernel, num_cores=target.num_cores, soft_fp8=soft_fp8), ""
        reasons.append(reason)
    if allow_interpret:
        for kernel in NAMES[name]:
            backend = KERNELS[kernel].backend
            if KERNELS[kernel].interpretable:
                if refusal(backend, kernel, target, interpret=True) is None:
                    return AttentionImpl(backend, kernel, interpret=True), ""
    return None, "; ".join(reasons)
