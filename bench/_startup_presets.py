"""bench/startup.py's presets: the engines and models of each run, and experiment 4's
SamplingParams features."""

from __future__ import annotations

from dataclasses import dataclass

import _jaxserve_runs
import throughput

# Experiment 4: a small engine on the built-in model (tiny: the fewest buckets that still fit
# n=3, as experiments 1-3 have).
FEATURE_ENGINE = dict(
    model="tiny-random-llama",
    block_size=16,
    num_kv_blocks=129,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=256,
)
FEATURE_ENGINE_TINY = dict(
    model="tiny-random-llama",
    block_size=16,
    num_kv_blocks=33,
    max_num_seqs=4,
    max_num_batched_tokens=4,
    max_model_len=64,
)
FEATURE_PROMPTS = ("Hello, my name is", "The capital of France is", "Once upon a time there")
# SamplingParams of each feature (max_tokens 16 unless given).
FEATURES: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "sampled (temperature, top_p, top_k, min_p)": dict(
        temperature=0.8, top_p=0.9, top_k=20, min_p=0.05
    ),
    "seed": dict(temperature=1.0, seed=1234),
    "penalties (presence, frequency, repetition)": dict(
        temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2
    ),
    "min_tokens": dict(temperature=0.0, min_tokens=12),
    "logprobs=5": dict(logprobs=5),
    "prompt_logprobs=3": dict(prompt_logprobs=3),
    "n=3": dict(n=3, temperature=0.8),
    "stop strings": dict(stop=["e", " the"]),
    "stop_token_ids": dict(stop_token_ids=[5, 17, 300]),
    "ignore_eos": dict(ignore_eos=True, max_tokens=24),
}
# Last, in the same process: every feature's params at once, one prompt each, in one batch
# (rows with and without penalties side by side).
MIXED = "mixed (one batch, a feature a prompt)"


@dataclass(frozen=True)
class Preset:
    """The models and engine settings of one run."""

    demo_flags: tuple[str, ...]  # engine flags for `jaxserve generate` (() = its defaults)
    engine: dict  # LLM arguments of experiments 2 and 3 (model: None = llama-57m)
    feature_engine: dict  # LLM arguments of experiment 4
    repeats: int = 1  # experiment 3: runs per worker count, alternated
    description: str = ""


def _throughput_engine() -> dict:
    """LLM arguments of bench/throughput.py's default preset, as _jaxserve_runs.build_engine
    passes them (model filled in later: its checkpoint is written on first use)."""
    s = _jaxserve_runs.EngineSettings(model="", **throughput.PRESETS["default"].engine)
    return dict(
        model=None,
        dtype="float32",
        block_size=s.block_size,
        num_kv_blocks=s.num_kv_blocks + 1,  # build_engine adds the null block
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=s.max_model_len,
        enable_prefix_caching=True,
        seed=s.seed,
    )


# The fewest compilations that still run everything: T in {1, 4}, two variants, two copies.
_TINY_ENGINE = dict(
    block_size=16, num_kv_blocks=17, max_num_seqs=2, max_num_batched_tokens=4, max_model_len=64
)

PRESETS = {
    "default": Preset(
        demo_flags=(),
        engine=_throughput_engine(),
        feature_engine=FEATURE_ENGINE,
        repeats=2,
        description="demo with default engine settings; llama-57m with throughput.py's engine",
    ),
    "tiny": Preset(
        demo_flags=tuple(
            x for k, v in _TINY_ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))
        ),
        engine=dict(model="tiny-random-llama", **_TINY_ENGINE),
        feature_engine=FEATURE_ENGINE_TINY,
        description="tiny-random-llama with a small engine everywhere (for tests)",
    ),
}
