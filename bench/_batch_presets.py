"""bench/batch.py's presets: the model, the engine settings and the workload of a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Preset:
    model: str  # a built-in model, or "checkpoint:<bench/throughput.py preset>"
    vocab_size: int
    engine: dict  # LLM keyword arguments (dtype, seed and the cache folder are added)
    num_requests: int
    dataset_kw: dict = field(default_factory=dict)
    ray: bool = True
    bracket: bool = True
    child_timeout_s: float = 1800.0


PRESETS = {
    # bench/throughput.py's default: llama-57m and its engine settings.
    "default": Preset(
        model="checkpoint:default",
        vocab_size=32000,
        engine=dict(
            block_size=32,
            num_kv_blocks=4096 + 1,  # 4096 usable + the null block, as bench/_jaxserve_runs.py
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            max_model_len=2048,
        ),
        num_requests=128,
    ),
    # For tests/bench: seconds per path.
    "tiny": Preset(
        model="tiny-random-llama",
        vocab_size=1024,
        engine=dict(
            block_size=8,
            num_kv_blocks=64,
            max_num_seqs=8,
            max_num_batched_tokens=8,  # = max_num_seqs: 4 step shapes; prompts (<= 40) take chunks
            max_model_len=128,
        ),
        num_requests=12,
        dataset_kw=dict(mean_input=12, mean_output=10, max_prompt_len=40, max_total_len=64),
        ray=False,
        bracket=False,
        child_timeout_s=300.0,
    ),
}


def resolve_model(preset: Preset, cache: Path) -> str:
    if not preset.model.startswith("checkpoint:"):
        return preset.model
    import throughput  # its checkpoint presets and ensure_checkpoint

    return str(
        throughput.ensure_checkpoint(throughput.PRESETS[preset.model.split(":", 1)[1]], cache)
    )
