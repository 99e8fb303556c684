"""Users on CPU get correct numbers: building an engine turns off the XLA:CPU fusion that jaxlib
0.10.2 miscompiles (jax-ml/jax#39103), on the affected versions only. The reproducer from that
issue runs in fresh processes, since the flag only acts before jax starts its CPU backend."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from jaxserve.runner.xla_flags import (
    CPU_YNN_FUSION_FLAG,
    apply_cpu_workarounds,
    workaround_needed,
)

REPRO = """
import sys
if sys.argv[1] == "with-jaxserve":
    from jaxserve.runner.xla_flags import apply_cpu_workarounds
    apply_cpu_workarounds()  # what building an engine does first
import jax, jax.numpy as jnp
n = 32_769
i = jnp.arange(n, dtype=jnp.float32)
x = jnp.stack((i, jnp.zeros_like(i), jnp.zeros_like(i)), axis=1)
matrix = jnp.eye(3, dtype=jnp.float32)
f = lambda x: jax.vmap(lambda row: jnp.sum((matrix @ row) ** 2))(x)
print(float(f(x)[-1]), float(jax.jit(f)(x)[-1]))
"""


def _run(mode: str) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", REPRO, mode], env=env, check=True, capture_output=True, text=True
    ).stdout.split()
    return float(out[-2]), float(out[-1])


def test_jaxserve_gives_correct_jit_results_on_cpu():
    eager, jitted = _run("with-jaxserve")
    assert eager == jitted == 32768.0**2


def test_the_reproducer_is_live_on_the_affected_jax():
    """Without the workaround, jax 0.10.2 gets it wrong: the test above is not vacuous."""
    if not workaround_needed():
        pytest.skip(f"jaxlib {jax.__version__} is not a version the workaround is for")
    eager, jitted = _run("plain")
    assert eager == 32768.0**2
    assert jitted != eager


def test_only_affected_versions_get_the_flag(monkeypatch):
    assert workaround_needed("0.10.2") and not workaround_needed("0.11.2")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr("jaxserve.runner.xla_flags.workaround_needed", lambda: False)
    assert not apply_cpu_workarounds() and "XLA_FLAGS" not in os.environ
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=")  # the user's own
    assert apply_cpu_workarounds()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type="


def test_too_late_is_said_not_silently_ignored(monkeypatch, caplog):
    """In this process jax has started already: the flag cannot act, and a warning says so."""
    jax.devices()
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr("jaxserve.runner.xla_flags.workaround_needed", lambda: True)
    with caplog.at_level("WARNING", logger="jaxserve"):
        assert not apply_cpu_workarounds()
    assert CPU_YNN_FUSION_FLAG in caplog.text and "XLA_FLAGS" not in os.environ
