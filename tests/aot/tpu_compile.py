"""Compile-only TPU devices for the tests of tests/aot: libtpu describes a TPU topology without
a chip (jaxserve/aot/devices.py). Tests that need them skip, saying why, where libtpu is not
installed (``pip install "jaxserve[tpu]"``) or cannot describe the topology."""

from __future__ import annotations

import functools

import pytest

from jaxserve.aot.devices import compile_devices, compiler_missing
from jaxserve.aot.targets import get_target


def require_tpu_compiler(target_name: str = "v6e-1") -> None:
    """Skip the calling test unless this process can compile for ``target_name``."""
    reason = compiler_missing(get_target(target_name))
    if reason is not None:
        pytest.skip(f"no deviceless TPU compile here: {reason}")
    try:
        _devices(target_name)
    except Exception as e:  # libtpu present but unable to describe the topology
        pytest.skip(f"libtpu cannot describe {target_name} here: {type(e).__name__}: {e}")


@functools.cache
def _devices(target_name: str) -> tuple:
    target = get_target(target_name)
    return tuple(compile_devices(target, target.num_chips))


def tpu_devices(target_name: str, num_devices: int) -> list:
    """The first ``num_devices`` compile-only devices of the target (require_tpu_compiler
    first)."""
    return list(_devices(target_name)[:num_devices])
