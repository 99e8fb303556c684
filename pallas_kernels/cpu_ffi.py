"""This project's C++ CPU kernels: built on first use, registered as XLA FFI custom calls.

XLA:CPU runs some of the engine's work (one decode row's attention, the sampler's draw) as
many tiny ops or several passes over memory; a few hundred lines of C++ per kernel do it in
one streaming pass. There is no build step and no extra Python dependency: the first call
compiles the kernel's source with the machine's C++ compiler ($CXX, else c++ / g++ /
clang++) against jaxlib's FFI headers, into a cache directory ($JAXSERVE_CACHE_DIR, else
$XDG_CACHE_HOME/jaxserve or ~/.cache/jaxserve), keyed by the sources, the flags, the
compiler, the jaxlib version and the CPU's feature flags (the build targets this CPU:
-march=native). Set JAXSERVE_CPU_KERNEL=0 to never build or use any of them. When a kernel
cannot be built, `available()` is False and `unavailable_reason()` says why; its callers then
take their XLA path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

FLAGS = (
    "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
    # Lets the compiler vectorise sums (reassociation); no fast-math shortcuts on infinities
    # or NaNs.
    "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
)  # fmt: skip
ENV_SWITCH = "JAXSERVE_CPU_KERNEL"
_INCLUDE_DIR = Path(__file__).parent  # cpu_kernels.h, shared by the kernels
_HEADERS = (_INCLUDE_DIR / "cpu_kernels.h",)


def cache_dir() -> Path:
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


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def build(source: Path) -> Path:
    """Compile `source` (or find it in the cache) into a shared library; raises RuntimeError
    with the reason (no compiler, or the compiler's errors)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
    key = hashlib.sha256(
        b"\0".join(
            [
                source.read_bytes(),
                *(h.read_bytes() for h in _HEADERS),
                " ".join(FLAGS).encode(),
                cxx.encode(),
                jaxlib.__version__.encode(),
                _cpu_signature().encode(),
            ]
        )
    ).hexdigest()[:16]
    lib = cache_dir() / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", str(_INCLUDE_DIR), "-I", jax.ffi.include_dir(), str(source)]
    cmd += ["-o", tmp]
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


class CpuKernel:
    """One C++ source exporting one XLA FFI handler `symbol`, registered for the CPU platform
    as the custom-call target `target` on first use (once per process)."""

    def __init__(self, source: Path, symbol: str, target: str) -> None:
        self.source = source
        self.symbol = symbol
        self.target = target
        self._lock = threading.Lock()
        self._done = False
        self._reason: str | None = None

    def load(self) -> str | None:
        """Build, load and register the kernel once; None when ready, else the reason."""
        with self._lock:
            if not self._done:
                self._reason = self._load()
                self._done = True
            return self._reason

    def _load(self) -> str | None:
        if os.environ.get(ENV_SWITCH, "1") == "0":
            return f"disabled by {ENV_SWITCH}=0"
        try:
            lib = ctypes.cdll.LoadLibrary(str(build(self.source)))
            handler = getattr(lib, self.symbol)
            jax.ffi.register_ffi_target(self.target, jax.ffi.pycapsule(handler), platform="cpu")
        except (RuntimeError, OSError, AttributeError, subprocess.SubprocessError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    def available(self) -> bool:
        """Whether the kernel is built and registered (building it on the first call)."""
        return self.load() is None

    def unavailable_reason(self) -> str | None:
        """Why `available()` is False, or None."""
        return self.load()

    def require(self) -> None:
        """Raises RuntimeError (with the reason) when the kernel is not available."""
        reason = self.load()
        if reason is not None:
            raise RuntimeError(f"the C++ CPU kernel {self.source.name} is not available: {reason}")
