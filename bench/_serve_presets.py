"""bench/serve.py's presets and constants: a model, engine limits, a request set and
the rates that belong together."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import throughput  # noqa: E402

CACHE = HERE / ".cache"
RESULTS = HERE / "results"
DEFAULT_VLLM_PYTHON = throughput.DEFAULT_VLLM_PYTHON
# "jaxserve-sync" is jaxserve with --no-async-scheduling: `--servers jaxserve,jaxserve-sync`
# runs async scheduling on and off side by side (comparison["async_over_sync"]).
SERVERS = ("jaxserve", "jaxserve-sync", "vllm")
SERVED_NAME = "bench"  # --served-model-name of both servers
TTFT_SLO_S = 2.0
WARM_UP_MAX_TOKENS = 8
GOAL_SERVED_OVER_OFFLINE = 0.90
GOAL_RATE_RATIO = 1.5
INF = float("inf")


@dataclass(frozen=True)
class ServePreset:
    """A model, engine limits, a request set and the rates that belong together."""

    model: str  # a bench/throughput.py preset (its checkpoint) or a built-in jaxserve model
    builtin: bool  # model is a jaxserve built-in name (no folder: vLLM cannot serve it)
    engine: dict  # block_size, num_kv_blocks (usable), max_num_seqs, ...
    num_requests: int
    dataset_kw: dict = field(default_factory=dict)
    rates: tuple[float, ...] | None = None  # fixed rates (req/s); None: fractions
    rate_fractions: tuple[float, ...] = (0.5, 1.0, 2.0)
    servers: tuple[str, ...] = ("jaxserve", "vllm")
    output: str = "serve.json"
    # Saturation runs of jaxserve, each right after an offline run of the same requests: the
    # served / offline goal is the median of those pairs (the 2-core machine's speed drifts by
    # 10-20% between runs minutes apart, more than what serving costs).
    overhead_repeats: int = 3
    # Bisection runs per server for its sustained rate, after the grid (0: the grid alone).
    search_steps: int = 3


PRESETS = {
    # bench/throughput.py's default model (~57M params, fp32) and engine settings.
    "default": ServePreset(
        model="default",
        builtin=False,
        engine=dict(throughput.PRESETS["default"].engine),
        # 128 requests and four rates: both servers' runs take ~20 minutes on 2 busy cores.
        # Neither server queues below max_num_seqs (chunked prefill admits each arrival within
        # a step), so the rates reach well past saturation to find where p99 TTFT breaks.
        num_requests=128,
        rate_fractions=(0.5, 1.0, 2.0, 4.0),
    ),
    # The default model with a batch cap that queues: at 32 running sequences a server admits
    # arrivals only as others finish, so p99 TTFT grows once the rate passes what it sustains
    # (with 256 neither server queues and the TTFT goal's rate cannot tell them apart). Rates
    # from half to twice jaxserve's saturation rate, in steps fine enough to place that knee.
    "queueing": ServePreset(
        model="default",
        builtin=False,
        engine=dict(throughput.PRESETS["default"].engine, max_num_seqs=32),
        num_requests=96,
        rate_fractions=(0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
        overhead_repeats=5,
        output="serve_queueing.json",
    ),
    # For tests/bench: the built-in demo model, a handful of short requests, one rate.
    "tiny": ServePreset(
        model="tiny-random-llama",
        builtin=True,
        engine=dict(  # few shapes to compile: T in {1, 16} x B in {1, 2} (bench's smoke)
            block_size=16,
            num_kv_blocks=32,
            max_num_seqs=8,
            max_num_batched_tokens=16,
            max_model_len=32,
        ),
        num_requests=6,
        dataset_kw=dict(mean_input=8, mean_output=8, max_prompt_len=16, max_total_len=32),
        rates=(8.0,),
        servers=("jaxserve",),
        overhead_repeats=1,
        search_steps=0,
        output="serve_tiny.json",
    ),
}
TINY_VOCAB = 1024  # the built-in model's vocabulary
