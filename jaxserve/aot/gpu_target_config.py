"""The GpuTargetConfig of a GPU target: what XLA:GPU compiles for when no GPU is attached.

XLA's GPU compiler reads the device description (compute capability, SMs, shared memory,
registers, threads, clock, memory size and bandwidth, L2) from a ``GpuTargetConfigProto``;
``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=<its text
form>, topology="1x1xN")`` gives N compile-only devices of that GPU (jax's CUDA plugin and the
CUDA libraries installed: ``pip install "jaxserve[cuda12]"``). The text is built here from the
target's table (targets.py), so every figure has one source; fields left out take XLA's
defaults. The limits every CUDA GPU since Volta shares (1024 threads per block, warps of 32,
48 KiB of static shared memory per block, grid limits) are constants.
"""

from __future__ import annotations

from jaxserve.aot.targets import AcceleratorTarget

_CUDA_LIMITS = """  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  registers_per_block_limit: 65536
"""


def gpu_target_config(target: AcceleratorTarget) -> str:
    """The text-format GpuTargetConfigProto of a GPU target.

    Raises:
        ValueError: ``target`` is not a GPU.
    """
    if target.platform != "gpu":
        raise ValueError(f"gpu_target_config needs a GPU target, got {target.name}")
    major, minor = target.compute_capability.split(".")
    return (
        "gpu_device_info {\n"
        + _CUDA_LIMITS
        + f"  shared_memory_per_core: {target.shared_memory_per_sm}\n"
        f"  shared_memory_per_block_optin: {target.shared_memory_per_block}\n"
        f"  threads_per_core_limit: {target.threads_per_sm}\n"
        f"  core_count: {target.num_sms}\n"
        f"  fpus_per_core: {target.fp32_units_per_sm}\n"
        f"  memory_bandwidth: {int(target.memory_bandwidth)}\n"
        f"  l2_cache_size: {target.l2_cache_bytes}\n"
        f"  clock_rate_ghz: {target.clock_mhz / 1000}\n"
        f"  device_memory_size: {target.memory_bytes}\n"
        f"  cuda_compute_capability {{\n    major: {major}\n    minor: {minor}\n  }}\n"
        f"  registers_per_core_limit: {target.registers_per_sm}\n"
        f'  device_vendor: "NVIDIA Corporation"\n'
        f'  name: "{target.device_kind}"\n'
        "}\n"
        'platform_name: "CUDA"\n'
        f'device_description_str: "{target.device_kind}"\n'
    )
