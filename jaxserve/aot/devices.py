"""Compile-only devices of a named target: jax can compile for them, on a machine without one.

TPU: libtpu (``pip install "jax[tpu]"``, the version of the installed jax) describes any
topology without a chip: ``jax.experimental.topologies.get_topology_desc(platform="tpu",
topology_name="v6e:2x2", chips_per_host_bounds=[2, 2, 1])`` gives its devices, over which a
``Mesh`` compiles ``jax.jit(...).lower(...).compile()`` with XLA:TPU and Mosaic. The target's
one host holds all its chips (v5litepod-8 and v6e-8 are single hosts of 2x4 chips).

GPU: jax's CUDA plugin and the CUDA libraries (``pip install "jax[cuda12]"``) compile for a
GPU described by a GpuTargetConfig (gpu_target_config.py): ``get_topology_desc(platform=
"cuda", target_config=..., topology="1x1xN")`` gives N compile-only devices of it, on a machine
without a GPU (CUDA_VISIBLE_DEVICES=-1 and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 keep the plugin
from looking for one: the CLI sets them).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

from jaxserve.aot.gpu_target_config import gpu_target_config
from jaxserve.aot.targets import AcceleratorTarget


class CompilerMissing(RuntimeError):
    """The compiler for a target is not installed (or not supported) here; the message says
    what to install."""


def install_hint(platform: str) -> str:
    """What to install for ``platform``'s compiler: the jaxserve extra and the jax extra under
    it, pinned to the installed jax."""
    extra = {"tpu": "tpu", "gpu": "cuda12"}[platform]
    try:
        version = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - jax is a dependency
        version = None
    pinned = f'"jax[{extra}]=={version}"' if version else f'"jax[{extra}]"'
    return f'pip install "jaxserve[{extra}]" (that is, pip install {pinned})'


# jax's CUDA plugins, any of which compiles for a GPU target: "jax[cuda12]" (what the extra
# installs) or "jax[cuda13]" (jax 0.11's GPU machines ship it).
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def compiler_missing(target: AcceleratorTarget) -> str | None:
    """Why this process cannot compile for ``target`` (with what to install), or None."""
    if target.platform == "tpu":
        if importlib.util.find_spec("libtpu") is None:
            return (
                f"compiling for {target.name} needs the TPU compiler (libtpu), which is not "
                f"installed: {install_hint('tpu')}"
            )
        return None
    if not any(importlib.util.find_spec(m) is not None for m in CUDA_PLUGINS):
        return (
            f"compiling for {target.name} needs the CUDA compiler (jax's CUDA 12 plugin and the "
            f"CUDA libraries, ~5 GB), which is not installed: {install_hint('gpu')}"
        )
    return None


# jax's GPU allocator takes this share of a GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION
# says otherwise; the engine plans with that limit (kv_cache.device_memory_bytes: bytes_limit).
JAX_GPU_MEMORY_FRACTION = 0.75


def planning_memory_bytes(target: AcceleratorTarget) -> int:
    """The memory of one device the engine would plan with there: on a GPU the allocator's
    limit (jax's default share of it, or XLA_PYTHON_CLIENT_MEM_FRACTION as set here, as it
    would be set there); on a TPU the chip's HBM (its runtime keeps a little more back, which
    no spec gives)."""
    if target.platform != "gpu":
        return target.memory_bytes
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_GPU_MEMORY_FRACTION))
    return int(target.memory_bytes * fraction)


def compile_devices(target: AcceleratorTarget, num_devices: int) -> list:
    """The first ``num_devices`` compile-only devices of ``target``.

    Raises:
        CompilerMissing: the target's compiler is not installed (what to install named).
        ValueError: more devices than the target has.
    """
    if not 1 <= num_devices <= target.num_chips:
        raise ValueError(
            f"--tensor-parallel-size must be between 1 and the {target.num_chips} chips of "
            f"{target.name}, got {num_devices}"
        )
    reason = compiler_missing(target)
    if reason is not None:
        raise CompilerMissing(reason)
    from jax.experimental import topologies

    if target.platform == "gpu":
        topology = topologies.get_topology_desc(
            platform="cuda",
            target_config=gpu_target_config(target),
            topology=f"1x1x{num_devices}",
        )
        return list(topology.devices)[:num_devices]
    # Off a Cloud TPU VM, libtpu would otherwise ask the GCE metadata server which TPU this
    # host is (and wait for it); a compile-only topology is named, not discovered.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # libtpu takes a lockfile so that two processes never drive one host's chips; a compile-only
    # topology drives none, so another process holding libtpu (a second compile, a test worker
    # beside this one) must not stop it ("Internal error when accessing libtpu multi-process
    # lockfile").
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topology = topologies.get_topology_desc(
        platform="tpu",
        topology_name=target.topology_name,
        chips_per_host_bounds=list(target.chips_per_host_bounds),
    )
    return list(topology.devices)[:num_devices]
