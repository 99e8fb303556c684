"""bench/gpu_e2e.py's presets: a model shape, an engine configuration, a workload and a time plan
that belong together, and vLLM's published figure (context for the summary, not a measurement).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Context for the summary, not a measurement of this run.
PUBLISHED_VLLM = {
    "output_tokens_per_s": 6583.0,
    "model": "Llama-3.1-8B",
    "devices": "one GPU",
    "label": "published by vLLM, not measured here (other hardware, workload and settings)",
}


@dataclass(frozen=True)
class Preset:
    """A model shape, an engine configuration, a workload and a time plan that belong together."""

    name: str
    model: dict  # HF config.json fields
    engine: dict  # LLM(...) keyword arguments besides model, dtype, warmup
    num_requests: int
    dataset_kw: dict = field(default_factory=dict)  # sharegpt_like options
    hf_num_requests: int = 64  # the fixed subset transformers runs
    hf_batch_size: int = 64
    dtype: str = "bfloat16"
    shard_bytes: int = 4 << 30  # safetensors shard size
    budget_s: float = 600.0  # default --budget-s
    # Seconds kept back for each later phase (its minimum), and the most a phase may take.
    reserve_s: dict = field(default_factory=lambda: {"hf": 75.0, "warm": 60.0})
    cap_s: dict = field(default_factory=lambda: {"hf": 90.0})
    min_phase_s: float = 20.0  # a phase with less time than this is skipped
    run_reserve_s: float = 45.0  # the cold phase stops compiling buckets to keep this for its run
    warmup_requests: int = 4  # untimed requests before the timed run (host paths, sampler)
    check_requests: int = 8  # the warm phase's short generate


LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    tie_word_embeddings=False,
    initializer_range=0.02,
    bos_token_id=128000,
    eos_token_id=128001,
    dtype="bfloat16",
    torch_dtype="bfloat16",
    use_cache=True,
)


PRESETS = {
    "llama3-8b": Preset(
        name="llama3-8b",
        model=LLAMA3_8B,
        engine=dict(
            block_size=16,
            max_model_len=2048,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
        ),
        num_requests=512,
        hf_num_requests=64,
        hf_batch_size=64,
    ),
    # For tests/bench: the same code path on CPU in seconds.
    "tiny": Preset(
        name="tiny",
        model=dict(
            LLAMA3_8B,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
        ),
        engine=dict(
            block_size=16,
            max_model_len=64,
            max_num_seqs=4,
            max_num_batched_tokens=4,  # token buckets 1 and 4: four compilations in all
            num_kv_blocks=64,
        ),
        num_requests=8,
        dataset_kw=dict(mean_input=12, mean_output=8, max_prompt_len=32, max_total_len=64),
        hf_num_requests=8,
        hf_batch_size=4,
        dtype="float32",  # XLA:CPU compiles the float32 step faster; the GPU runs bfloat16
        shard_bytes=40_000,  # several shards and an index, as the 8B checkpoint has
        budget_s=300.0,
        reserve_s={"hf": 40.0, "warm": 40.0},
        min_phase_s=10.0,
        run_reserve_s=5.0,
        warmup_requests=2,
        check_requests=2,
    ),
}
