"""Named accelerators to compile for without one: their facts, from public specifications.

    name        chip                 per chip: memory, HBM bandwidth, dense bf16 peak
    h100        NVIDIA H100 SXM5     80 GiB HBM3, 3.35 TB/s, 989 TFLOP/s      sm_90, 132 SMs
    h200        NVIDIA H200 SXM      141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s      sm_90, 132 SMs
    a100-80g    NVIDIA A100 80GB SXM 80 GiB HBM2e, 2.039 TB/s, 312 TFLOP/s    sm_80, 108 SMs
    l4          NVIDIA L4            24 GiB GDDR6, 300 GB/s, 121 TFLOP/s      sm_89, 58 SMs
    v5e-N       TPU v5e (v5 lite)    16 GiB HBM2, 819 GB/s, 197 TFLOP/s       N = 1, 4, 8 chips
    v6e-N       TPU v6e (Trillium)   32 GiB HBM, 1640 GB/s, 918 TFLOP/s       N = 1, 4, 8 chips

Sources (peak figures are dense, without sparsity):
- H100 / H200: NVIDIA H100 datasheet and H200 product page (nvidia.com/en-us/data-center/h100,
  /h200): BF16 Tensor Core 1,979 TFLOP/s with sparsity (989 dense), 3.35 / 4.8 TB/s; NVIDIA
  Hopper tuning guide (docs.nvidia.com/cuda/hopper-tuning-guide): 132 SMs on H100 SXM5, 228 KB
  shared memory per SM of which 227 KB for one block, 64K 32-bit registers, 2048 threads and
  128 FP32 units per SM; 50 MB L2.
- A100: NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): BF16 312 TFLOP/s dense,
  2,039 GB/s (80GB SXM); Ampere tuning guide: 108 SMs, 164 KB shared memory per SM (163 KB
  for one block), 2048 threads and 64 FP32 units per SM; 40 MB L2.
- L4: NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4): BF16 242 TFLOP/s with sparsity
  (121 dense), 24 GB GDDR6, 300 GB/s; Ada tuning guide: 100 KB shared memory per SM (99 KB
  for one block), 1536 threads and 128 FP32 units per SM; 58 SMs and 48 MB L2 (the AD104
  configuration of the L4).
- TPU v5e: cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s per chip,
  1,600 Gbps ICI per chip; v5litepod-1 / -4 / -8 are one host of 1x1, 2x2, 2x4 chips.
- TPU v6e: cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB HBM at 1,640 GB/s per chip,
  3,584 Gbps ICI per chip; v6e-1 / -4 / -8 are one host of 1x1, 2x2, 2x4 chips.

Memory is counted in GiB (2^30) where the vendor's "GB" of an HBM capacity is the binary
size (80 GB = 80 GiB of HBM3; the runtime keeps a little of it: an attached device's
allocator limit is a few percent lower, so plans against these figures are optimistic by
that much). H200's 141 GB is decimal (141e9 bytes, 131 GiB).

The roofline (roofline.py) reads peak_flops and memory_bandwidth; the GPU fields also make
the GpuTargetConfig of a deviceless CUDA compile and the chip facts of the execution plan
(compute capability -> the kernel generation, SMs -> kernel tuning).
"""

from __future__ import annotations

import dataclasses

GIB = 1 << 30
TERA = 10**12


@dataclasses.dataclass(frozen=True)
class AcceleratorTarget:
    """One named chip configuration to compile for.

    name: the --target name.
    platform: "gpu" | "tpu".
    device_kind: what jax's device_kind reports on the real chip (the plan's messages).
    num_chips: devices in the target (the most --tensor-parallel-size it takes).
    memory_bytes: memory of one chip (HBM / GDDR).
    memory_bandwidth: bytes/s of one chip's memory.
    peak_flops: dense bf16 FLOP/s of one chip.
    topology_name, chips_per_host_bounds: the TPU topology (jax.experimental.topologies)
        of the target's one host; None on GPU.
    compute_capability, num_sms, shared_memory_per_block (the opt-in maximum of one block),
        shared_memory_per_sm, registers_per_sm, threads_per_sm, fp32_units_per_sm,
        l2_cache_bytes, clock_mhz: the GPU's (CUDA; gpu_target_config.py); None on TPU.
    source: where the figures come from (the module docstring has the details).
    """

    name: str
    platform: str
    device_kind: str
    num_chips: int
    memory_bytes: int
    memory_bandwidth: float
    peak_flops: float
    source: str
    topology_name: str | None = None
    chips_per_host_bounds: tuple[int, int, int] | None = None
    compute_capability: str | None = None
    num_sms: int | None = None
    shared_memory_per_block: int | None = None
    shared_memory_per_sm: int | None = None
    registers_per_sm: int | None = None
    threads_per_sm: int | None = None
    fp32_units_per_sm: int | None = None
    l2_cache_bytes: int | None = None
    clock_mhz: int | None = None

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _SM:
    """One streaming multiprocessor of a GPU generation (the tuning guides')."""

    smem_kb: int  # shared memory per SM
    smem_block_kb: int  # of which one block may opt in to
    threads: int
    fp32_units: int


_HOPPER_SM = _SM(228, 227, 2048, 128)
_A100_SM = _SM(164, 163, 2048, 64)
_ADA_SM = _SM(100, 99, 1536, 128)


def _gpu(
    name: str,
    kind: str,
    memory: int,
    bandwidth: float,
    flops: float,
    cc: str,
    sms: int,
    sm: _SM,
    l2_mb: int,
    clock: int,
    source: str,
) -> AcceleratorTarget:
    """A GPU target from its datasheet figures."""
    return AcceleratorTarget(
        name=name,
        platform="gpu",
        device_kind=kind,
        num_chips=1,
        memory_bytes=memory,
        memory_bandwidth=bandwidth,
        peak_flops=flops,
        source=source,
        compute_capability=cc,
        num_sms=sms,
        shared_memory_per_block=sm.smem_block_kb * 1024,
        shared_memory_per_sm=sm.smem_kb * 1024,
        registers_per_sm=65536,
        threads_per_sm=sm.threads,
        fp32_units_per_sm=sm.fp32_units,
        l2_cache_bytes=l2_mb << 20,
        clock_mhz=clock,
    )


def _tpu(generation: str, kind: str, chips: int, memory: int, bandwidth: float, flops: float,
         source: str) -> AcceleratorTarget:  # fmt: skip
    bounds = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}[chips]
    return AcceleratorTarget(
        name=f"{generation}-{chips}",
        platform="tpu",
        device_kind=kind,
        num_chips=chips,
        memory_bytes=memory,
        memory_bandwidth=bandwidth,
        peak_flops=flops,
        source=source,
        topology_name=f"{generation}:{bounds[0]}x{bounds[1]}",
        chips_per_host_bounds=bounds,
    )


_NV = "nvidia.com/en-us/data-center/"
_V5E = "cloud.google.com/tpu/docs/v5e"
_V6E = "cloud.google.com/tpu/docs/v6e"

TARGETS: dict[str, AcceleratorTarget] = {
    t.name: t
    for t in (
        # name, device kind, memory, bandwidth, dense bf16, compute capability, SMs, SM,
        # L2 MiB, clock MHz, source
        _gpu(
            "h100",
            "NVIDIA H100 80GB HBM3",
            80 * GIB,
            3.35e12,
            989 * TERA,
            "9.0",
            132,
            _HOPPER_SM,
            50,
            1980,
            _NV + "h100",
        ),
        _gpu(
            "h200",
            "NVIDIA H200",
            141 * 10**9,
            4.8e12,
            989 * TERA,
            "9.0",
            132,
            _HOPPER_SM,
            50,
            1980,
            _NV + "h200",
        ),
        _gpu(
            "a100-80g",
            "NVIDIA A100-SXM4-80GB",
            80 * GIB,
            2.039e12,
            312 * TERA,
            "8.0",
            108,
            _A100_SM,
            40,
            1410,
            _NV + "a100",
        ),
        _gpu(
            "l4", "NVIDIA L4", 24 * GIB, 300e9, 121 * TERA, "8.9", 58, _ADA_SM, 48, 2040, _NV + "l4"
        ),
        *(_tpu("v5e", "TPU v5 lite", n, 16 * GIB, 819e9, 197 * TERA, _V5E) for n in (1, 4, 8)),
        *(_tpu("v6e", "TPU v6 lite", n, 32 * GIB, 1640e9, 918 * TERA, _V6E) for n in (1, 4, 8)),
    )
}


def get_target(name: str) -> AcceleratorTarget:
    """The target called ``name``.

    Raises:
        ValueError: an unknown name (the known ones listed).
    """
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"--target must be one of {', '.join(TARGETS)}; got {name!r}") from None


def chip_facts(target: AcceleratorTarget) -> dict[str, object]:
    """The execution plan's facts of the target's chip (ops.device_facts' keys): what the plan
    would read from the attached device there."""
    from jaxserve.pallas_kernels.ragged_paged_attention import gpu_generation
    from jaxserve.pallas_kernels.ragged_paged_attention.ops import cuda_runtime_version

    facts: dict[str, object] = dict(platform=target.platform, device_kind=target.device_kind)
    if target.platform == "gpu":
        facts["gpu_generation"] = gpu_generation(target.compute_capability)
        facts["compute_capability"] = target.compute_capability
        facts["num_cores"] = target.num_sms
        # ptxas is the installed CUDA's, wherever the GPU is: its known bugs apply
        facts["cuda_runtime_version"] = cuda_runtime_version()
    return facts
