"""How many step executables an engine on the CPU may compile before the process runs out of
memory maps.

XLA:CPU JIT-compiles each kernel of an executable (every fusion) into memory of its own: about
three maps (code, read-only data, data) a kernel, some 130 kernels a step, so ~360 maps per
compiled step for a 2-layer model and ~430 for 8 layers (jaxlib 0.10.2, measured with
/proc/self/maps). The maps stay while jax holds the executable, i.e. for the engine's life.
Linux caps a process at ``vm.max_map_count`` maps (65,530 by default); past it mmap fails,
LLVM reports "Cannot allocate memory" and the process dies with a segmentation fault. The
executables multiply where the attention implementation is not length-bounded (the reference,
e.g. under tensor parallelism when the KV heads do not split): one per token bucket x table
width x sampler variant, 104 steps (43k maps) for a tiny model at tensor_parallel_size=4 and
max_model_len=128, and more at longer contexts.

So on the CPU the step's shapes get a budget: half the process's map limit (the rest is for
libraries, thread stacks, arrays and a second engine in the same process), at
MAPS_PER_EXECUTABLE each. BucketSpec.create thins the table widths to fit it.
"""

from __future__ import annotations

import pathlib

MAPS_PER_EXECUTABLE = 512  # above the ~360-430 measured (module docstring)
MAP_COUNT_FILE = pathlib.Path("/proc/sys/vm/max_map_count")
DEFAULT_MAX_MAP_COUNT = 65_530  # Linux's default, where the file cannot be read


def max_map_count() -> int:
    """The process's memory-map limit (Linux), else Linux's default."""
    try:
        return int(MAP_COUNT_FILE.read_text())
    except (OSError, ValueError):
        return DEFAULT_MAX_MAP_COUNT


def max_executables(map_limit: int | None = None) -> int:
    """Compiled executables (steps and block copies) one CPU engine may hold: half of
    ``map_limit`` (default: max_map_count()) at MAPS_PER_EXECUTABLE each, at least 8."""
    limit = max_map_count() if map_limit is None else map_limit
    return max(8, limit // 2 // MAPS_PER_EXECUTABLE)


def max_step_shapes(max_executables: int | None, num_variants: int, num_copies: int) -> int | None:
    """(T, R, B) shapes that fit ``max_executables`` (None: no budget) when each costs
    ``num_variants`` executables and the block copy ``num_copies`` sizes; at least 1. The
    runner passes its two sampler variants: a shape's forward half and its share of the
    sample halves (two per row bucket, much smaller than a forward), within the bound."""
    if max_executables is None:
        return None
    return max(1, (max_executables - num_copies) // num_variants)
