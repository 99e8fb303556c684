"""The runner: the only bridge between the host (scheduler) and the device (models, kernels)."""

from jaxserve.runner.xla_flags import apply_cpu_workarounds

# Must run before jax starts its CPU backend (see xla_flags.py).
apply_cpu_workarounds()
