"""Ragged paged attention: a jnp reference and kernels sharing one signature (signature.py),
the kernels as data (kernels.py), the registry that chooses one for a Target (registry.py) as
an AttentionImpl (impl.py), and a by-name entry point for tests (ops.py)."""

from jaxserve.pallas_kernels.ragged_paged_attention.chunked import ragged_paged_attention_chunked
from jaxserve.pallas_kernels.ragged_paged_attention.gpu import (
    GpuConfig,
    default_gpu_config,
    ragged_paged_attention_gpu,
)
from jaxserve.pallas_kernels.ragged_paged_attention.impl import AttentionImpl
from jaxserve.pallas_kernels.ragged_paged_attention.kernels import KERNELS, KernelSpec
from jaxserve.pallas_kernels.ragged_paged_attention.ops import (
    device_facts,
    gpu_generation,
    implementation_for,
    ragged_paged_attention,
)
from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
    write_kv,
)
from jaxserve.pallas_kernels.ragged_paged_attention.registry import (
    AUTO_ORDER,
    BACKENDS,
    auto_order,
    runnable_names,
    select_attention,
)
from jaxserve.pallas_kernels.ragged_paged_attention.signature import AttentionKernel
from jaxserve.pallas_kernels.ragged_paged_attention.target import Target
from jaxserve.pallas_kernels.ragged_paged_attention.tpu import (
    TpuConfig,
    default_tpu_config,
    ragged_paged_attention_tpu,
)

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "KERNELS",
    "AttentionImpl",
    "AttentionKernel",
    "GpuConfig",
    "KernelSpec",
    "Target",
    "TpuConfig",
    "auto_order",
    "default_gpu_config",
    "default_tpu_config",
    "device_facts",
    "gpu_generation",
    "implementation_for",
    "ragged_paged_attention",
    "ragged_paged_attention_chunked",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu",
    "runnable_names",
    "select_attention",
    "write_kv",
]
