"""Each data-parallel replica's share of the machine: which cores (CPU) or which GPUs it may
use, as process environment and CPU affinity, decided before any replica starts.

The front loads no jax (it would take the devices it hands out), so the platform comes from
$JAX_PLATFORMS when set, else from what the machine shows: NVIDIA GPUs under
/proc/driver/nvidia/gpus, else the CPU. On the CPU each replica is pinned to an equal slice of
the cores this process may use; XLA sizes its thread pools from the affinity mask, so a
replica's compiler and step threads stay on its slice. On GPUs each replica sees
``tensor_parallel_size`` of them through $CUDA_VISIBLE_DEVICES. TPUs are refused: splitting one
host's chips between processes needs libtpu's process bounds, which nothing here sets yet.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger("jaxserve")

_NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


@dataclass(frozen=True)
class Placement:
    """One replica's share. env: variables set in its process (on top of the front's);
    cpus: the cores it is pinned to, None: not pinned."""

    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] | None = None


def detect_platform(environ: Mapping[str, str]) -> str:
    """'cpu', 'gpu' or 'tpu': $JAX_PLATFORMS' first entry if set (cuda / rocm are 'gpu'),
    else 'gpu' when NVIDIA GPUs are present, else 'cpu'."""
    given = environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if given:
        return "gpu" if given in ("gpu", "cuda", "rocm") else given
    if os.path.isdir(_NVIDIA_GPUS) and os.listdir(_NVIDIA_GPUS):
        return "gpu"
    return "cpu"


def plan_placements(
    num_replicas: int,
    tensor_parallel_size: int,
    platform: str,
    *,
    cpus: Sequence[int],
    gpus: Sequence[str],
) -> list[Placement]:
    """The placements of ``num_replicas`` replicas of ``tensor_parallel_size`` devices each.

    Args:
        platform: 'cpu' or 'gpu' (detect_platform).
        cpus: the cores the replicas share (this process's affinity).
        gpus: the GPU ids they share ($CUDA_VISIBLE_DEVICES' entries, or 0..n-1).

    Raises:
        ValueError: a platform that cannot be split, or too few GPUs for N x tp.
    """
    if num_replicas < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {num_replicas}")
    if platform == "gpu":
        need = num_replicas * tensor_parallel_size
        if need > len(gpus):
            raise ValueError(
                f"--data-parallel-size {num_replicas} x --tensor-parallel-size "
                f"{tensor_parallel_size} needs {need} GPUs; this machine shows {len(gpus)}"
            )
        tp = tensor_parallel_size
        return [
            Placement(env={"CUDA_VISIBLE_DEVICES": ",".join(gpus[r * tp : (r + 1) * tp])})
            for r in range(num_replicas)
        ]
    if platform != "cpu":
        raise ValueError(
            f"--data-parallel-size > 1 is supported on cpu and gpu, not on {platform!r} "
            "(splitting a TPU host's chips between processes is not implemented)"
        )
    share = len(cpus) // num_replicas
    if share == 0:
        logger.warning(
            "%d replicas on %d cores: the replicas share every core (not pinned)",
            num_replicas,
            len(cpus),
        )
        return [Placement() for _ in range(num_replicas)]
    ordered = sorted(cpus)
    return [
        Placement(cpus=tuple(ordered[r * share : (r + 1) * share])) for r in range(num_replicas)
    ]


def machine_devices(environ: Mapping[str, str]) -> tuple[list[int], list[str]]:
    """(cores this process may use, GPU ids it may use) as plan_placements takes them."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        cpus = list(range(os.cpu_count() or 1))
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    elif os.path.isdir(_NVIDIA_GPUS):
        gpus = [str(i) for i in range(len(os.listdir(_NVIDIA_GPUS)))]
    else:
        gpus = []
    return cpus, gpus
