"""bench/throughput.py's presets (a model, engine limits and dataset shapes that belong together)
and their random-weight checkpoints, written once into the cache; other benchmarks use them too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

CACHE = Path(__file__).resolve().parent / ".cache"
ALL_BASELINES = ("static", "nocache", "hf", "vllm", "vllm-nocache")


@dataclass(frozen=True)
class Preset:
    """A model, engine limits and dataset shapes that belong together."""

    model_name: str
    model: dict  # write_tiny_hf_checkpoint overrides
    engine: dict  # EngineSettings fields (model excluded)
    datasets: tuple[str, ...]
    num_requests: int
    dataset_kw: dict = field(default_factory=dict)  # dataset name -> builder options
    baselines: tuple[str, ...] = ALL_BASELINES
    output: str = "throughput.json"
    limits: dict = field(default_factory=dict)  # machine_limits sizes


PRESETS = {
    # ~57M parameters (24M in the layers, 2 x 16M embedding + lm_head), fp32.
    "default": Preset(
        model_name="llama-57m",
        model=dict(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            initializer_range=0.02,
        ),
        engine=dict(
            block_size=32,
            num_kv_blocks=4096,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            max_model_len=2048,
        ),
        datasets=("sharegpt", "prefix"),
        num_requests=64,
    ),
    "quick": Preset(
        model_name="llama-tiny-1m",
        model=dict(
            vocab_size=2048,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=0.02,
        ),
        engine=dict(
            block_size=32,
            num_kv_blocks=256,
            max_num_seqs=64,
            max_num_batched_tokens=256,
            max_model_len=256,
        ),
        datasets=("sharegpt", "prefix"),
        num_requests=16,
        dataset_kw={
            "sharegpt": dict(mean_input=40, mean_output=60, max_prompt_len=128, max_total_len=256),
            "prefix": dict(num_prefixes=2, prefix_len=64, suffix_len=64, output_len=32),
        },
        baselines=("static", "nocache", "hf", "vllm"),  # a second vLLM start-up: over 3 min
        output="throughput_quick.json",
    ),
    # For tests/bench: seconds, not minutes (4 step shapes, T in {1, 4, 6, 8}: 16 programs).
    "smoke": Preset(
        model_name="llama-smoke",
        model=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            initializer_range=0.02,
        ),
        engine=dict(
            block_size=16,
            num_kv_blocks=16,
            max_num_seqs=8,
            max_num_batched_tokens=8,  # = max_num_seqs: the fewest buckets; prompts take chunks
            max_model_len=32,
        ),
        datasets=("sharegpt", "prefix"),
        num_requests=4,
        dataset_kw={
            "sharegpt": dict(mean_input=8, mean_output=6, max_prompt_len=16, max_total_len=32),
            "prefix": dict(num_prefixes=2, prefix_len=16, suffix_len=4, output_len=4),
        },
        baselines=("static", "nocache", "hf"),
        output="throughput_smoke.json",
        limits=dict(matmul_n=256, copy_mib=16),
    ),
}


def ensure_checkpoint(preset: Preset, cache: Path = CACHE) -> Path:
    """The preset's random checkpoint, written once into `cache` (rewritten if its config
    changed)."""
    folder = cache / preset.model_name
    marker = folder / "bench_overrides.json"
    wanted = json.dumps(preset.model, sort_keys=True)
    if marker.exists() and marker.read_text() == wanted and (folder / "config.json").exists():
        return folder
    from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint

    write_tiny_hf_checkpoint(folder, "llama", with_tokenizer=False, **preset.model)
    marker.write_text(wanted)
    return folder
