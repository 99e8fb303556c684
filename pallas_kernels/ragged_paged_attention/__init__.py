"""Ragged paged attention: a jnp reference and Pallas kernels sharing one signature."""

from jaxserve.pallas_kernels.ragged_paged_attention.ops import BACKENDS, ragged_paged_attention
from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
    write_kv,
)

__all__ = ["BACKENDS", "ragged_paged_attention", "ragged_paged_attention_reference", "write_kv"]
