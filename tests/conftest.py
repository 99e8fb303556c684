"""Test-session set-up shared by every test module."""

from __future__ import annotations

# jax 0.10.2 miscompiles a jitted vmapped mat-vec + reduction on CPU (jax-ml/jax#39103). The
# runner's fix (jaxserve/runner/xla_flags.py) must be in XLA_FLAGS before jax initialises its
# CPU backend, and a test module may import jax before anything from jaxserve.runner: apply it
# first.
from jaxserve.runner.xla_flags import apply_cpu_workarounds  # imports no jax

apply_cpu_workarounds()
