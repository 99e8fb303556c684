"""What attention must run on: the chip, the model's attention shapes and options.

A ``Target`` is built once per engine (the execution plan, from jax's first device or a
compile-only topology) and is everything the registry needs to pick a kernel: no kernel asks
which platform it runs on while it is traced.
"""

from __future__ import annotations

import dataclasses

PLATFORMS = ("cpu", "gpu", "tpu")
# GPU generations by CUDA compute capability: Hopper (9.x) runs Mosaic GPU (its WGMMA kernel);
# Blackwell and newer (>= 10) and Ampere / Ada (8.x) run Triton; older ones the XLA ones.
BLACKWELL, HOPPER, AMPERE, OLDER_GPU = "blackwell+", "hopper", "ampere-ada", "pre-ampere"
ALL_DTYPES = ("float32", "bfloat16", "float16")
FP8_KV_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # KV page dtypes of an FP8 KV cache


@dataclasses.dataclass(frozen=True)
class Target:
    """The platform and chip, the model's attention shapes and options, the tensor-parallel
    degree."""

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
    cuda_runtime_version: int | None = None  # e.g. 12090, of the attached GPU's jax plugin
    compute_capability: str | None = None  # CUDA's, e.g. "8.0" (None: not an NVIDIA GPU)
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

    @property
    def converts_e4m3(self) -> bool:
        """Whether the chip converts float8_e4m3fn natively: everything but NVIDIA GPUs below
        compute capability 8.9 (Ampere's sm_80 / sm_86), where Triton cannot emit the cast and
        the Triton kernel converts e4m3 pages with integer ops instead (kv_quant.py)."""
        if self.platform != "gpu" or self.compute_capability is None:
            return True
        major, _, minor = self.compute_capability.partition(".")
        try:
            return (int(major), int(minor or 0)) >= (8, 9)
        except ValueError:
            return True

    @property
    def where(self) -> str:
        """The chip for messages: its device kind, else the platform."""
        return self.device_kind or self.platform
