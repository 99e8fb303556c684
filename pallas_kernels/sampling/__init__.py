"""Kernels for the sampler (jaxserve/runner/sampler.py)."""
