"""The machine an engine is planned for: its mesh, the chip's facts and its memory.

Usually the devices of this process (``Machine.attached``): the chip's facts come from jax's
first device, its memory from the allocator, and the attention kernel the plan picks is
self-checked on it. Ahead-of-time compilation (jaxserve/aot/) plans for a chip that is not
attached: a named target's compile-only devices (a mesh jax can compile for but not run on),
its facts and its memory from the target's table; nothing can run there, so nothing is
self-checked. Either way the execution plan (plan.py) and the memory plan (memory_plan.py)
are made from these fields alone: nothing below asks which platform it runs on.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.pallas_kernels.ragged_paged_attention import device_facts
from jaxserve.runner.kv_cache import device_memory_bytes


@dataclasses.dataclass(frozen=True)
class Machine:
    """mesh: the 1-D "tp" mesh (sharding.make_mesh), of attached or compile-only devices.
    chip: the Target fields that describe the chip (ops.device_facts' keys: platform,
        device_kind, gpu_generation, num_cores, cuda_runtime_version, compute_capability).
    memory_bytes: memory of one device to plan with; None: ask the attached device's allocator
        (kv_cache.device_memory_bytes).
    attached: the devices are this process's, so kernels can run on them (the plan's
        self-check); False for compile-only devices.
    """

    mesh: jax.sharding.Mesh
    chip: dict[str, object]
    memory_bytes: int | None = None
    attached: bool = True

    @classmethod
    def of_mesh(cls, mesh: jax.sharding.Mesh) -> Machine:
        """The machine of a mesh of this process's devices."""
        return cls(mesh=mesh, chip=device_facts(mesh.devices.flat[0]))

    @property
    def platform(self) -> str:
        return str(self.chip["platform"])

    def device_memory(self, cpu_memory_bytes: int) -> int:
        """Bytes of one device to plan with (on the CPU: ``cpu_memory_bytes``).

        Raises:
            RuntimeError: an attached GPU / TPU that reports no memory limit.
        """
        if self.memory_bytes is not None:
            return self.memory_bytes
        return device_memory_bytes(self.mesh.devices.flat[0], cpu_memory_bytes)
