"""Compile-only devices for the tests of tests/aot: libtpu describes a TPU topology without a
chip, and jax's CUDA plugin a GPU from its GpuTargetConfig (jaxserve/aot/devices.py). Tests that
need them skip, saying why, where the compiler is not installed (``pip install
"jaxserve[tpu]"`` / ``"jaxserve[cuda12]"``) or cannot describe the target."""

from __future__ import annotations

import functools

import pytest

from jaxserve.aot.devices import compile_devices, compiler_missing
from jaxserve.aot.targets import get_target


def require_compiler(target_name: str) -> None:
    """Skip the calling test unless this process can compile for ``target_name``."""
    reason = compiler_missing(get_target(target_name))
    if reason is not None:
        pytest.skip(f"no deviceless compile here: {reason}")
    try:
        _devices(target_name)
    except Exception as e:  # the compiler is there but cannot describe the target
        pytest.skip(f"cannot describe {target_name} here: {type(e).__name__}: {e}")


@functools.cache
def _devices(target_name: str) -> tuple:
    target = get_target(target_name)
    return tuple(compile_devices(target, target.num_chips))


def compile_only_devices(target_name: str, num_devices: int) -> list:
    """The first ``num_devices`` compile-only devices of the target (require_compiler first)."""
    return list(_devices(target_name)[:num_devices])
