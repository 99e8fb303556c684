"""Every ragged paged attention kernel, as data: its entry point, where it runs and on what,
and the static options it takes. Adding a kernel is its own file and one entry in KERNELS
(plus, when it should be picked by default, a place in registry.AUTO_ORDER).

A ``KernelSpec`` declares where a kernel runs natively (platforms, GPU generations), whether it
runs in Pallas interpret mode elsewhere (tests), what it takes (dtypes, sliding window, soft
cap, FP8 pages), whether its cost stops at each sequence's length, whether it runs per device
under ``shard_map``, and why it cannot run in this process (``available``) or for a chip's
toolchain (``target_refusal``). Shapes (head dims, page sizes, GQA groups) are checked by the
kernel's own validation on the target's shapes, so those rules live in one place.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable

from jaxserve.pallas_kernels.ragged_paged_attention import cpu_rows
from jaxserve.pallas_kernels.ragged_paged_attention.chunked import ragged_paged_attention_chunked
from jaxserve.pallas_kernels.ragged_paged_attention.gpu import (
    pltriton,
    ragged_paged_attention_gpu,
)
from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
)
from jaxserve.pallas_kernels.ragged_paged_attention.signature import AttentionKernel
from jaxserve.pallas_kernels.ragged_paged_attention.target import (
    ALL_DTYPES,
    AMPERE,
    BLACKWELL,
    HOPPER,
    PLATFORMS,
    Target,
)
from jaxserve.pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

# The static options an AttentionImpl may hand a kernel (KernelSpec.options names a subset).
IMPL_OPTIONS = ("interpret", "num_cores", "soft_fp8")


def _never(_: Target) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel: ``entry()`` gives its function (imported on first use where its module needs
    optional jax extras); ``backend`` is the attention_backend name it is reported under."""

    backend: str
    entry: Callable[[], AttentionKernel | None]
    platforms: tuple[str, ...]  # where it runs natively
    gpu_generations: tuple[str, ...] = ()  # on "gpu": the generations it runs on (all if empty)
    interpretable: bool = False  # runs in Pallas interpret mode off its platform (tests only)
    dtypes: tuple[str, ...] = ALL_DTYPES
    sliding_window: bool = True
    soft_cap: bool = True
    length_bounded: bool = True  # its cost stops at each sequence's (or the batch's) length
    shard_map: bool = True  # runs per device inside shard_map under tensor parallelism
    fp8_kv: bool = True  # reads FP8 KV pages (with their k_scale / v_scale)
    options: tuple[str, ...] = ()  # of IMPL_OPTIONS, passed from the AttentionImpl
    fixed: tuple[tuple[str, object], ...] = ()  # keyword options always passed
    available: Callable[[], str | None] = lambda: None  # why not in this process, or None
    target_refusal: Callable[[Target], str | None] = _never  # why not on this chip, or None

    def __post_init__(self) -> None:
        unknown = set(self.options) - set(IMPL_OPTIONS)
        if unknown:
            raise ValueError(f"KernelSpec.options must be among {IMPL_OPTIONS}, got {unknown}")


def _triton_available() -> str | None:
    return None if pltriton is not None else "this jax has no Pallas Triton backend"


def _cpu_rows_available() -> str | None:
    if cpu_rows.available():
        return None
    return f"its C++ kernel does not build here ({cpu_rows.unavailable_reason()})"


_MOSAIC_GPU_MODULE = "jaxserve.pallas_kernels.ragged_paged_attention.mosaic_gpu"


@functools.cache
def mosaic_gpu_kernel() -> AttentionKernel | None:
    """The Mosaic GPU kernel function, or None when this jax has no Pallas Mosaic GPU backend
    (imported on first use: the module needs jax's mosaic_gpu extras)."""
    try:
        return importlib.import_module(_MOSAIC_GPU_MODULE).ragged_paged_attention_mosaic_gpu
    except (ImportError, AttributeError):
        return None


def _mosaic_gpu_available() -> str | None:
    if mosaic_gpu_kernel() is None:
        return "this jax has no Pallas Mosaic GPU backend"
    return None


def masked_wgmma_refusal(target: Target) -> str | None:
    """ptxas of CUDA 12.8.0 to 12.9.0 miscompiles the score mask in the WGMMA layout (iota
    comparisons; jax's own Mosaic GPU flash attention refuses masked attention there too)."""
    version = target.cuda_runtime_version
    if version is not None and 12080 <= version < 12091:
        return (
            f"it masks scores, which ptxas of CUDA 12.8.0 to 12.9.0 miscompiles (jax's flash "
            f"attention refuses it there too); CUDA runtime {version} found: use CUDA >= "
            "12.9.1 or the 'pallas_triton' backend"
        )
    return None


KERNELS: dict[str, KernelSpec] = {
    # The reference is partitioned by GSPMD under tensor parallelism (plain XLA ops).
    "reference": KernelSpec(
        "reference",
        lambda: ragged_paged_attention_reference,
        PLATFORMS,
        length_bounded=False,
        shard_map=False,
    ),
    "xla": KernelSpec("xla", lambda: ragged_paged_attention_chunked, PLATFORMS),
    "cpu": KernelSpec(
        "cpu",
        lambda: ragged_paged_attention_chunked,
        ("cpu",),
        dtypes=("float32",),
        fp8_kv=False,
        fixed=(("row_kernel", "cpu"),),
        available=_cpu_rows_available,
    ),
    # WGMMA takes half precision (float32 would run as tf32): float32 models take Triton.
    "mosaic_gpu": KernelSpec(
        "pallas_mosaic_gpu",
        mosaic_gpu_kernel,
        ("gpu",),
        gpu_generations=(HOPPER,),
        interpretable=True,
        dtypes=("bfloat16", "float16"),
        fp8_kv=False,
        options=("interpret", "num_cores"),
        available=_mosaic_gpu_available,
        target_refusal=masked_wgmma_refusal,
    ),
    "triton": KernelSpec(
        "pallas_triton",
        lambda: ragged_paged_attention_gpu,
        ("gpu",),
        gpu_generations=(BLACKWELL, HOPPER, AMPERE),
        interpretable=True,
        options=("interpret", "num_cores", "soft_fp8"),
        available=_triton_available,
    ),
    "mosaic_tpu": KernelSpec(
        "pallas_tpu",
        lambda: ragged_paged_attention_tpu,
        ("tpu",),
        interpretable=True,
        options=("interpret",),
    ),
}
