"""bench/attention_kernel.py's presets (attention shapes, the decode and prefill grid, timing
repeats), the default backends per platform and the tolerance against the reference.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Preset:
    batches: tuple[int, ...]  # decode batch sizes
    contexts: tuple[int, ...]  # decode context lengths
    prefills: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]  # (name, ((q_len, kv_len), ...))
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int  # of the prefill cases, and of the decode cases when page_sizes is empty
    dtype: str
    copy_bytes: int  # size of the copy probes
    inner: int  # op calls per timed program
    repeats: int  # timed programs per case (median reported)
    memory_fraction: float = 0.7  # of device memory a case may use
    page_sizes: tuple[int, ...] = ()  # decode page sizes (empty: page_size)
    kv_split_variants: bool = False  # Triton decode rows again without KV splits

    @property
    def decode_page_sizes(self) -> tuple[int, ...]:
        return self.page_sizes or (self.page_size,)


PRESETS = {
    "h200": Preset(
        batches=(1, 8, 64, 256),
        contexts=(512, 4096, 32768),
        prefills=(
            ("prefill 1x2048 fresh", ((2048, 2048),)),
            ("prefill 4x512 chunk @4k", ((512, 4096),) * 4),
            ("mixed 1x1024 + 63 decodes @4k", ((1024, 1024),) + ((1, 4096),) * 63),
        ),
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        dtype="bfloat16",
        copy_bytes=2 << 30,
        inner=20,
        repeats=5,
        kv_split_variants=True,
    ),
    # bench/gpu_check.sh's stage: decode of 64 sequences x 4096 tokens (Llama-3-8B's attention
    # shapes), page sizes 16 and 32, every GPU implementation; well under a minute.
    "h200-decode": Preset(
        batches=(64,),
        contexts=(4096,),
        prefills=(),
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        page_sizes=(16, 32),
        dtype="bfloat16",
        copy_bytes=2 << 30,
        inner=10,
        repeats=5,
    ),
    "cpu-smoke": Preset(
        batches=(1, 4),
        contexts=(64,),
        prefills=(("mixed 1x16 + 3 decodes @48", ((16, 16),) + ((1, 48),) * 3),),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        dtype="float32",
        copy_bytes=8 << 20,
        inner=2,
        repeats=2,
    ),
}


DEFAULT_BACKENDS = {
    "gpu": ("xla", "pallas_triton", "pallas_mosaic_gpu"),
    "tpu": ("xla", "pallas_tpu"),
    "cpu": ("xla", "pallas_triton"),
}


# A kernel whose output differs from the reference by more than this (outputs are O(1)) is
# flagged in its row ("mismatch"): the numbers of a wrong kernel mean nothing.
TOLERANCE = {"float32": 2e-3, "bfloat16": 6e-2, "float16": 1e-2}


MAX_ERROR_CHARS = 600  # of an error message kept in a row
