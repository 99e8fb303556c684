"""XLA flags the runner needs before jax initialises its backend.

jax/jaxlib 0.10.2 miscompile a jitted, vmapped mat-vec followed by a reduction on CPU
(jax-ml/jax#39103): YNNPACK library fusions produce wrong numbers. Of the fusion types the flag
``--xla_cpu_experimental_ynn_fusion_type`` selects (dot, eltwise, reduce, individual_dot,
individual_convolution), each of dot, eltwise and reduce alone reproduces the bug; the
individual_dot type alone (one dot per YNNPACK call, nothing fused into it) gives correct
results, and keeps YNNPACK's faster GEMMs: the 57M benchmark model's dense layers at 256 tokens
take 82 ms with it against 110-127 ms with every YNN fusion off (an empty value). The flag only
takes effect if it is in XLA_FLAGS before the CPU backend starts, so jaxserve.runner applies it
on import; ``cpu_workaround_active()`` reports whether it is in force. A user's own value of the
flag is left alone.
"""

from __future__ import annotations

import os

CPU_YNN_FUSION_FLAG = "--xla_cpu_experimental_ynn_fusion_type=individual_dot"


def apply_cpu_workarounds() -> None:
    """Append the CPU miscompile workaround to XLA_FLAGS unless the user set that flag."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_cpu_experimental_ynn_fusion_type" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + CPU_YNN_FUSION_FLAG).strip()


def cpu_workaround_active() -> bool:
    return "--xla_cpu_experimental_ynn_fusion_type" in os.environ.get("XLA_FLAGS", "")
