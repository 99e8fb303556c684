"""Users on CPU get correct numbers: jaxserve.runner turns off the XLA:CPU fusion that jax 0.10.2
miscompiles (jax-ml/jax#39103). The reproducer from that issue runs in fresh processes, since
the flag only acts before jax starts its CPU backend."""

from __future__ import annotations

import os
import subprocess
import sys

import jax

REPRO = """
import sys
if sys.argv[1] == "with-jaxserve":
    import jaxserve.runner  # noqa: F401  (applies the workaround before jax starts)
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
    if jax.__version__ != "0.10.2":
        return  # other versions are not affected; nothing to show
    eager, jitted = _run("plain")
    assert eager == 32768.0**2
    assert jitted != eager
