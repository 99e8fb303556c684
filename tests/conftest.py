"""Test-session set-up shared by every test module."""

from __future__ import annotations

import os

# jax 0.10.2 miscompiles a jitted vmapped mat-vec + reduction on CPU (jax-ml/jax#39103); this flag
# turns off the fusion at fault. It must be set before jax initialises its CPU backend. The
# runner applies the same fix for users (jaxserve/runner/xla_flags.py).
_FLAG = "--xla_cpu_experimental_ynn_fusion_type="
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
