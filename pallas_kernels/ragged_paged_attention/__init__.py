"""Ragged paged attention: a jnp reference and Pallas kernels sharing one signature."""

from jaxserve.pallas_kernels.ragged_paged_attention.chunked import ragged_paged_attention_chunked
from jaxserve.pallas_kernels.ragged_paged_attention.gpu import (
    GpuConfig,
    default_gpu_config,
    ragged_paged_attention_gpu,
)
from jaxserve.pallas_kernels.ragged_paged_attention.ops import (
    BACKENDS,
    LENGTH_BOUNDED_BACKENDS,
    default_attention_backend,
    ragged_paged_attention,
    resolve_backend,
)
from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
    write_kv,
)
from jaxserve.pallas_kernels.ragged_paged_attention.tpu import (
    TpuConfig,
    default_tpu_config,
    ragged_paged_attention_tpu,
)

__all__ = [
    "BACKENDS",
    "LENGTH_BOUNDED_BACKENDS",
    "GpuConfig",
    "TpuConfig",
    "default_attention_backend",
    "default_gpu_config",
    "default_tpu_config",
    "ragged_paged_attention",
    "ragged_paged_attention_chunked",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu",
    "resolve_backend",
    "write_kv",
]
