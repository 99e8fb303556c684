"""XLA flags the runner needs before jax initialises its backend.

jax/jaxlib 0.10.2 miscompile a jitted, vmapped mat-vec followed by a reduction on CPU
(jax-ml/jax#39103): the "ynn" fusion produces wrong numbers. Turning that fusion off
(``--xla_cpu_experimental_ynn_fusion_type=`` with an empty value) gives correct results; 0.10.1 and
later releases with the fix are unaffected, and the flag is harmless there. The flag only takes
effect if it is in XLA_FLAGS before the CPU backend starts, so jaxserve.runner applies it on
import; ``cpu_workaround_active()`` reports whether it is in force.
"""

from __future__ import annotations

import os

CPU_YNN_FUSION_FLAG = "--xla_cpu_experimental_ynn_fusion_type="


def apply_cpu_workarounds() -> None:
    """Append the CPU miscompile workaround to XLA_FLAGS unless the user set that flag."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_cpu_experimental_ynn_fusion_type" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + CPU_YNN_FUSION_FLAG).strip()


def cpu_workaround_active() -> bool:
    return "--xla_cpu_experimental_ynn_fusion_type" in os.environ.get("XLA_FLAGS", "")
