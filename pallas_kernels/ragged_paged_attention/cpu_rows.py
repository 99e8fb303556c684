"""The C++ row kernel (cpu_rows.cc) for the CPU: built on first use, called as an XLA FFI
custom call.

XLA:CPU runs one decode row's attention as tiny batched dots ([G, H] x [H, C] per KV head)
plus gathers of its pages, at a few GB/s; this kernel walks each row's pages directly and
streams them once. The xla backend's tile pass keeps the prefill tiles (real GEMMs there).

Building: the first call compiles cpu_rows.cc with the C++ compiler ($CXX, else c++ / g++)
against jaxlib's FFI headers into a cache directory ($JAXSERVE_CACHE_DIR, else
$XDG_CACHE_HOME/jaxserve or ~/.cache/jaxserve), keyed by the source, the flags, the jaxlib
version and the CPU's feature flags (the build targets this CPU: -march=native). Set
JAXSERVE_CPU_KERNEL=0 to never build or use it. When it cannot be built, `available()` is False
and says why in `unavailable_reason()`; the engine then picks the plain xla backend.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

_SOURCE = Path(__file__).with_name("cpu_rows.cc")
_TARGET = "jaxserve_ragged_paged_attention_cpu_rows"
_SYMBOL = "JaxserveRaggedPagedAttentionCpuRows"
_FLAGS = (
    "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
    # Lets the compiler vectorise the dot products' sums (reassociation); no fast-math
    # shortcuts on infinities or NaNs.
    "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
)  # fmt: skip
_ENV_SWITCH = "JAXSERVE_CPU_KERNEL"


def _cache_dir() -> Path:
    if os.environ.get("JAXSERVE_CACHE_DIR"):
        return Path(os.environ["JAXSERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxserve"


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build() -> Path:
    """Compile (or find in the cache) the shared library; raises RuntimeError with the reason."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [
                source,
                " ".join(_FLAGS).encode(),
                compiler.encode(),
                jaxlib.__version__.encode(),
                _cpu_signature().encode(),
            ]
        )  # fmt: skip
    ).hexdigest()[:16]
    lib = _cache_dir() / f"cpu_rows-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = [compiler, *_FLAGS, "-I", jax.ffi.include_dir(), str(_SOURCE), "-o", tmp]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if "error" in line]
            raise RuntimeError(f"{' '.join(cmd)} failed:\n" + "\n".join(errors[:20]))
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def _load() -> str | None:
    """Build, load and register the kernel once per process; None when ready, else the reason."""
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        return f"disabled by {_ENV_SWITCH}=0"
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        handler = getattr(lib, _SYMBOL)
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    except (RuntimeError, OSError, AttributeError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why `available()` is False, or None."""
    return _load()


def cpu_rows_attention(
    q: jax.Array,  # f32[T, N, H]
    k_pages: jax.Array,  # f32[K, S, P, H]
    v_pages: jax.Array,  # f32[K, S, P, H]
    kv_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, B]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    skip_rows: jax.Array,  # i32[R] leading rows of each sequence left to the caller
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> jax.Array:  # f32[T, N, H]
    """Attention of every query row past its sequence's first skip_rows[r] rows, with
    reference.py's semantics; all other rows (skipped ones, padding) are zero. Inputs are
    assumed validated (validation.validate_inputs) and f32.

    Raises:
        RuntimeError: the kernel is not available (see unavailable_reason()).
    """
    reason = _load()
    if reason is not None:
        raise RuntimeError(f"the C++ CPU attention kernel is not available: {reason}")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, skip_rows,
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )  # fmt: skip
