"""The engine step as one jitted program, forward and sample fused: the CPU's step
(ExecutionPlan.fused_step).

    fused(FUSED_ARGS)   per (T, R, B, sampler variant) of the shapes job_shapes.fused_shape
                        takes (T == R <= 64: the decode buckets): step.py's forward half, then
                        its sample half, in one executable; KV pages donated

On an accelerator the step's two halves (step.py) cost nothing extra: each launch is
asynchronous and hides behind the device's work, the logits stay in device memory between
them, and the split lets the host build the sample half's token masks while the forward runs.
On the CPU the "device" is the host's own cores: a second executable launch, with its argument
handling, and the logits written out and read back cost 0.15-0.45 ms a step, 8-43% of the
small models' 1-3 ms steps (docs/benchmarks.md). So the CPU's plan fuses the halves of its
short steps: the runner's forward half only stages the step (ModelRunner.run_forward returns
a StagedForward) and its sample half runs this program, token masks included (built before
the call: there is no forward to overlap them with). EngineCore does not know the difference.

The fused program is the composition of step.py's ``forward_fn`` and ``sample_fn``, so its
tokens are the split step's (tests/runner/test_fused_step.py); it compiles once per sampler
variant of each (T, R, B) where the split step compiles the model once per (T, R, B). Only the
decode-shaped buckets fuse: their row bucket is theirs alone, so a job's warm-up compiles the
sampler as often as split; fusing every shape compiled the sampler once per shape, and made
README's first command 1.4x slower to start (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxserve.models import CausalLM
from jaxserve.runner.sharding import ShardingPlan
from jaxserve.runner.step import (
    FORWARD_ARGS,
    SAMPLE_ARGS,
    SharedTraces,
    forward_fn,
    forward_shardings,
    sample_fn,
)

# The fused program's positional arguments: the forward half's, then the sample half's less
# the two the forward hands it (logits, pending outputs).
FUSED_ARGS = FORWARD_ARGS + SAMPLE_ARGS[2:]


@dataclass(frozen=True)
class StagedForward:
    """A forward half the fused step has not run yet: what ModelRunner.run_forward was given.
    The runner's sample half (run_sample) builds the program's arguments from it and the
    runner's state at that moment, and runs forward and sample at once."""

    prompt_targets: np.ndarray  # i32[T]: next prompt token per row, else -1


def jit_fused(
    model: CausalLM,
    sharding: ShardingPlan | None,
    draw: str,
    draft: CausalLM | None = None,
    draft_sharding: ShardingPlan | None = None,
) -> Any:
    """The jitted fused step: called with FUSED_ARGS, it returns (kv_caches, prompt logprobs,
    draft_kv_caches, sampler output, tokens emitted per segment, last sampled token per slot);
    the KV pages (and a draft model's) are donated."""
    draft_traces = None if draft is None else SharedTraces(draft)
    draft_layers = 0 if draft is None else draft.arch.num_layers
    return jax.jit(
        functools.partial(_fused_fn, SharedTraces(model), draft_traces, draw),
        donate_argnames=("kv_caches", "draft_kv_caches"),
        **_fused_shardings(sharding, model.arch.num_layers, draft_sharding, draft_layers),
    )


def _fused_fn(
    model: SharedTraces,
    draft: SharedTraces | None,
    draw: str,
    params: Any,
    kv_caches: Any,
    input_ids: jax.Array,
    md: Any,
    logits_indices: jax.Array,
    prompt_targets: jax.Array,
    feed: Any,
    draft_params: Any,
    draft_kv_caches: Any,
    draft_ids: jax.Array,
    sampling_md: Any,
    last_sampled: jax.Array,
    sample_slot: jax.Array,
    draft_q: Any = None,
):
    """step.py's forward half, then its sample half on the forward's logits."""
    kv_caches, logits, plp, pending, draft_kv_caches = forward_fn(
        model, draft, params, kv_caches, input_ids, md, logits_indices, prompt_targets, feed,
        draft_params, draft_kv_caches,
    )  # fmt: skip
    out, num_emitted, last_sampled = sample_fn(
        draw, logits, pending, draft_ids, sampling_md, last_sampled, sample_slot, draft_q
    )
    return kv_caches, plp, draft_kv_caches, out, num_emitted, last_sampled


def _fused_shardings(
    plan: ShardingPlan | None,
    num_layers: int,
    draft_plan: ShardingPlan | None,
    draft_layers: int,
) -> dict[str, Any]:
    """The forward half's shardings (step.py) for its arguments and results, the sample
    half's inputs and results replicated. No plan: jit's defaults (one device)."""
    if plan is None:
        return {}
    forward = forward_shardings(plan, num_layers, draft_plan, draft_layers)
    rep = plan.replicated
    kv, _, plp, _, draft_kv = forward["out_shardings"]
    return dict(
        in_shardings=(*forward["in_shardings"], *(rep,) * (len(SAMPLE_ARGS) - 2)),
        # kv_caches, prompt logprobs, draft KV, sampler output, num emitted, last sampled
        out_shardings=(kv, plp, draft_kv, rep, rep, rep),
    )
