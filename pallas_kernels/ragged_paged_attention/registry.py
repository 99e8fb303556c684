"""Every ragged paged attention implementation, what each supports, and the choice among them.

An implementation (``AttentionImpl``) is a small frozen object that calls one kernel with its
static options fixed: models hold it as static configuration and call it like a function, so
nothing below the engine's execution plan ever sees a backend name or asks which platform it
runs on. Its ``KernelSpec`` declares where it runs natively (platforms, GPU generations), on
what (dtypes, sliding window, soft cap), whether its cost stops at each sequence's length, and
whether it runs per device under ``shard_map``. Shapes (head dims, page sizes, GQA groups) are
checked by the kernel's own validation on the target's shapes, so the rules live in one place.

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
refused for it, so "auto" takes xla on the CPU and Triton on Hopper.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxserve.pallas_kernels.ragged_paged_attention import cpu_rows
from jaxserve.pallas_kernels.ragged_paged_attention.chunked import ragged_paged_attention_chunked
from jaxserve.pallas_kernels.ragged_paged_attention.gpu import (
    pltriton,
    ragged_paged_attention_gpu,
)
from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
)
from jaxserve.pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

PLATFORMS = ("cpu", "gpu", "tpu")
# GPU generations by CUDA compute capability: Hopper (9.x) runs Mosaic GPU (its WGMMA kernel);
# Blackwell and newer (>= 10) and Ampere / Ada (8.x) run Triton; older ones the XLA ones.
BLACKWELL, HOPPER, AMPERE, OLDER_GPU = "blackwell+", "hopper", "ampere-ada", "pre-ampere"
ALL_DTYPES = ("float32", "bfloat16", "float16")
FP8_KV_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # KV page dtypes of an FP8 KV cache


@dataclasses.dataclass(frozen=True)
class Target:
    """What attention must run on, and with: the platform, the model's attention shapes and
    options, the tensor-parallel degree."""

    platform: str  # "cpu" | "gpu" | "tpu"
    dtype: str  # of q and the KV pages
    num_q_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    page_size: int  # P
    sliding_window: int | None = None
    soft_cap: float | None = None
    gpu_generation: str | None = None  # BLACKWELL | HOPPER | AMPERE | OLDER_GPU on "gpu"
    device_kind: str = ""  # e.g. "NVIDIA H200", for messages
    num_cores: int | None = None  # GPU streaming multiprocessors, for kernel tuning
    tensor_parallel_size: int = 1
    kv_cache_dtype: str | None = None  # of the KV pages: None (= dtype) or FP8_KV_DTYPES

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ValueError(f"Target.platform must be one of {PLATFORMS}, got {self.platform!r}")
        kv_choices = (None, self.dtype, *FP8_KV_DTYPES)
        if self.kv_cache_dtype not in kv_choices:
            raise ValueError(
                f"Target.kv_cache_dtype must be one of {kv_choices}, got {self.kv_cache_dtype!r}"
            )

    @property
    def kv_dtype(self) -> str:
        """The KV pages' dtype name."""
        return self.kv_cache_dtype or self.dtype


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What one kernel supports. ``available`` says why it cannot be used in this process at
    all (a C++ build that failed, a jax without the Pallas backend), or None."""

    platforms: tuple[str, ...]  # where it runs natively
    gpu_generations: tuple[str, ...] = ()  # on "gpu": the generations it runs on (all if empty)
    interpretable: bool = False  # runs in Pallas interpret mode off its platform (tests only)
    dtypes: tuple[str, ...] = ALL_DTYPES
    sliding_window: bool = True
    soft_cap: bool = True
    length_bounded: bool = True  # its cost stops at each sequence's (or the batch's) length
    shard_map: bool = True  # runs per device inside shard_map under tensor parallelism
    fp8_kv: bool = True  # reads FP8 KV pages (with their k_scale / v_scale)
    available: Callable[[], str | None] = lambda: None


def _triton_available() -> str | None:
    return None if pltriton is not None else "this jax has no Pallas Triton backend"


def _cpu_rows_available() -> str | None:
    if cpu_rows.available():
        return None
    return f"its C++ kernel does not build here ({cpu_rows.unavailable_reason()})"


_MOSAIC_GPU_MODULE = "jaxserve.pallas_kernels.ragged_paged_attention.mosaic_gpu"


@functools.cache
def mosaic_gpu_kernel() -> Callable | None:
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


KERNELS: dict[str, KernelSpec] = {
    # The reference is partitioned by GSPMD under tensor parallelism (plain XLA ops).
    "reference": KernelSpec(PLATFORMS, length_bounded=False, shard_map=False),
    "xla": KernelSpec(PLATFORMS),
    "cpu": KernelSpec(("cpu",), dtypes=("float32",), fp8_kv=False, available=_cpu_rows_available),
    # WGMMA takes half precision (float32 would run as tf32): float32 models take Triton.
    "mosaic_gpu": KernelSpec(
        ("gpu",),
        gpu_generations=(HOPPER,),
        interpretable=True,
        dtypes=("bfloat16", "float16"),
        fp8_kv=False,
        available=_mosaic_gpu_available,
    ),
    "triton": KernelSpec(
        ("gpu",),
        gpu_generations=(BLACKWELL, HOPPER, AMPERE),
        interpretable=True,
        available=_triton_available,
    ),
    "mosaic_tpu": KernelSpec(("tpu",), interpretable=True),
}

# attention_backend names -> the kernels they may mean, in preference order.
NAMES: dict[str, tuple[str, ...]] = {
    "reference": ("reference",),
    "xla": ("xla",),
    "cpu": ("cpu",),
    "pallas_mosaic_gpu": ("mosaic_gpu",),
    "pallas_triton": ("triton",),
    "pallas_tpu": ("mosaic_tpu",),
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
# The name each kernel is reported under once chosen.
_KERNEL_NAMES = {kernels[0]: name for name, kernels in NAMES.items() if len(kernels) == 1}


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
    """One ragged paged attention implementation with its static options; call it with the
    signature of ``ragged_paged_attention_reference``.

    name: the attention_backend name it is reported under ("pallas_tpu", "cpu", ...).
    kernel: the key of its KernelSpec in KERNELS.
    interpret: run the Pallas kernel in interpret mode (tests off its platform).
    num_cores: GPU streaming multiprocessors, for the GPU kernels' tuning (None: a default).
    mesh, axis: under tensor parallelism, the mesh and its axis; the kernel then runs per
        device inside shard_map, on the device's query heads and their KV heads.
    """

    name: str
    kernel: str
    interpret: bool = False
    num_cores: int | None = None
    mesh: Mesh | None = None
    axis: str | None = None

    @property
    def spec(self) -> KernelSpec:
        return KERNELS[self.kernel]

    @property
    def length_bounded(self) -> bool:
        return self.spec.length_bounded

    def __call__(
        self,
        q: jax.Array,  # [T, N, H]
        k_pages: jax.Array,  # [K, S, P, H]
        v_pages: jax.Array,  # [K, S, P, H]
        kv_lens: jax.Array,  # i32[R]
        block_tables: jax.Array,  # i32[R, B]
        cu_q_lens: jax.Array,  # i32[R + 1]
        num_seqs: jax.Array,  # i32[1]
        *,
        sm_scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        k_scale: jax.Array | None = None,  # f32[] of an FP8 KV cache (kv_quant.py)
        v_scale: jax.Array | None = None,  # f32[]
    ) -> jax.Array:  # [T, N, H]
        local = functools.partial(
            self._local, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
        )
        args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
        # The scales travel as two more (replicated) positional arguments, or not at all.
        args += () if k_scale is None and v_scale is None else (k_scale, v_scale)
        if self.mesh is None or not self.spec.shard_map:
            return local(*args)
        heads = shard_heads(local, self.mesh, self.axis, q.shape[1], k_pages.shape[0], len(args))
        return heads(*args)

    def _local(self, *args, sm_scale, sliding_window, soft_cap) -> jax.Array:
        args, scales = args[:7], args[7:]
        options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
        if scales:
            options.update(k_scale=scales[0], v_scale=scales[1])
        kernel = self.kernel
        if kernel == "reference":
            return ragged_paged_attention_reference(*args, **options)
        if kernel == "xla":
            return ragged_paged_attention_chunked(*args, **options)
        if kernel == "cpu":
            return ragged_paged_attention_chunked(*args, **options, row_kernel="cpu")
        if kernel == "triton":
            return ragged_paged_attention_gpu(
                *args, **options, interpret=self.interpret, num_cores=self.num_cores
            )
        if kernel == "mosaic_gpu":
            return mosaic_gpu_kernel()(
                *args, **options, interpret=self.interpret, num_cores=self.num_cores
            )
        return ragged_paged_attention_tpu(*args, **options, interpret=self.interpret)


def shard_heads(
    fn: Callable[..., jax.Array],
    mesh: Mesh,
    axis: str,
    num_q_heads: int,
    num_kv_heads: int,
    num_args: int = 7,
) -> Callable[..., jax.Array]:
    """``fn`` run per device inside shard_map: each device attends with its slice of the query
    heads over its slice of the KV heads (the model's tensor-parallel layout: heads sharded
    where ``axis`` divides them, replicated where not). Metadata is replicated, and so are the
    arguments past the seventh (an FP8 cache's k_scale and v_scale: num_args 9).

    Raises:
        ValueError: the split does not nest (see head_split_refusal).
    """
    reason = head_split_refusal(num_q_heads, num_kv_heads, mesh.shape[axis])
    if reason is not None:
        raise ValueError(reason)
    tp = mesh.shape[axis]
    q_spec = PartitionSpec(None, axis, None) if num_q_heads % tp == 0 else PartitionSpec()
    kv_spec = PartitionSpec(axis) if num_kv_heads % tp == 0 else PartitionSpec()
    rep = PartitionSpec()
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, *(rep,) * (num_args - 3)),
        out_specs=q_spec,
        check_vma=False,
    )


def head_split_refusal(num_q_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why the per-device attention cannot run on ``tp`` devices, or None.

    Each device must hold whole GQA groups: its query heads and the KV heads they read. That
    holds when tp divides both N and K (each device: N / tp query heads, K / tp KV heads), or
    neither (everything replicated: each device computes every head). With tp | N but not K,
    the KV heads are replicated while the query heads are split, and a device would need a
    slice of the KV pages it cannot take without copying them every step: refused, so that
    "auto" takes the GSPMD-partitioned reference instead.
    """
    if tp == 1 or num_kv_heads % tp == 0 or num_q_heads % tp:
        return None
    return (
        f"tensor_parallel_size={tp} splits the {num_q_heads} query heads but not the "
        f"{num_kv_heads} KV heads: the per-device kernel would need part of the replicated KV "
        "pages"
    )


def refusal(name: str, kernel: str, target: Target, interpret: bool = False) -> str | None:
    """Why ``kernel`` (under the name ``name``) cannot run for ``target``, or None."""
    spec = KERNELS[kernel]
    where = target.device_kind or target.platform
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
        reason = refusal(_KERNEL_NAMES[kernel], kernel, target)
        if reason is None:
            return AttentionImpl(_KERNEL_NAMES[kernel], kernel, num_cores=target.num_cores), ""
        reasons.append(reason)
    if allow_interpret:
        for kernel in NAMES[name]:
            if KERNELS[kernel].interpretable:
                if refusal(_KERNEL_NAMES[kernel], kernel, target, interpret=True) is None:
                    return AttentionImpl(_KERNEL_NAMES[kernel], kernel, interpret=True), ""
    return None, "; ".join(reasons)
