"""Ragged paged attention: a jnp reference and kernels sharing one signature, the registry of
implementations that the execution plan chooses from, and a by-name entry point for tests."""

from jaxserve.pallas_kernels.ragged_paged_attention.chunked import ragged_paged_attention_chunked
from jaxserve.pallas_kernels.ragged_paged_attention.gpu import (
    GpuConfig,
    default_gpu_config,
    ragged_paged_attention_gpu,
)
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
    KERNELS,
    AttentionImpl,
    Target,
    auto_order,
    runnable_names,
    select_attention,
)
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
    "GpuConfig",
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
