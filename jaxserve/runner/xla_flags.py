"""The XLA:CPU miscompile workaround, applied when an engine is built, before jax starts.

jax/jaxlib 0.10.2 miscompile a jitted, vmapped mat-vec followed by a reduction on CPU
(jax-ml/jax#39103): YNNPACK library fusions produce wrong numbers. Of the fusion types the flag
``--xla_cpu_experimental_ynn_fusion_type`` selects (dot, eltwise, reduce, individual_dot,
individual_convolution), each of dot, eltwise and reduce alone reproduces the bug; the
individual_dot type alone (one dot per YNNPACK call, nothing fused into it) gives correct
results and keeps YNNPACK's faster GEMMs.

An XLA flag that the installed jaxlib does not know aborts the process, and the flag only
takes effect in XLA_FLAGS before jax starts its backends. So it is applied only for the jaxlib
versions checked to have both the bug and the flag (AFFECTED_JAXLIB: 0.10.2 checked, by
tests/runner/test_xla_flags.py's reproducer), when the engine is built (before it lists the
devices) rather than on import; it changes XLA:CPU only. A user's own value of the flag is left
alone. If jax's backends were already started by then, the workaround cannot act: a warning
says so and how to apply it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

CPU_YNN_FUSION_FLAG = "--xla_cpu_experimental_ynn_fusion_type=individual_dot"
AFFECTED_JAXLIB = ("0.10.",)  # version prefixes; 0.10.2 checked (bug and flag present)

logger = logging.getLogger("jaxserve")


def workaround_needed(jaxlib_version: str | None = None) -> bool:
    """Whether the installed (or given) jaxlib is one the workaround is for."""
    version = jaxlib_version or importlib.metadata.version("jaxlib")
    return version.startswith(AFFECTED_JAXLIB)


def apply_cpu_workarounds() -> bool:
    """Append the workaround to XLA_FLAGS where needed; returns whether it is in force (also
    when the user set the flag themselves)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_cpu_experimental_ynn_fusion_type" in flags:
        return True
    if not workaround_needed():
        return False
    if _backends_started():
        logger.warning(
            "jaxlib %s miscompiles some fused CPU computations (jax-ml/jax#39103), and jax "
            "started before the engine could turn the fusion off: set XLA_FLAGS=%s before "
            "using jax, or build the LLM first",
            importlib.metadata.version("jaxlib"),
            CPU_YNN_FUSION_FLAG,
        )
        return False
    os.environ["XLA_FLAGS"] = (flags + " " + CPU_YNN_FUSION_FLAG).strip()
    return True


def _backends_started() -> bool:
    try:  # private, hence guarded: where it is gone, assume not started
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - depends on the installed jax
        return False
    return bool(getattr(xla_bridge, "backends_are_initialized", lambda: False)())
