"""A roofline estimate of each compiled step on the target: its time, and tokens per second.

    step seconds = max(FLOPs / peak FLOP/s, bytes / memory bandwidth)     (per device)

FLOPs: the compiler's cost analysis of the step (the dense layers, the logits, the sampler)
plus attention's, counted here: a Pallas kernel is a custom call the compiler cannot see into
(it counts 0), so each token adds 4 N H x its context FLOPs per layer (QK^T and PV), over the
device's heads.

Bytes are counted here too, not taken from the compiler: XLA's cost analysis counts an update
of the donated KV pages as reading and writing the whole page array several times (a 64-token
scatter into 16 MB of pages is counted as 66 MB on XLA:TPU, and 10x the pages 10x the bytes),
so its figure grows with the pool, not with the step's traffic. The step's traffic is every
weight once (the memory plan's weights per device), each token's K/V written once, and the
KV each token reads: its context of K/V.

    decode    T sequences of one token each at a context of ``context`` tokens: T tok/step
    prefill   one chunk of T tokens from position 0 (average context T / 2): T tok/step

Not modelled: collectives under tensor parallelism (ICI / NVLink), kernel efficiency (real
kernels reach a fraction of either roof), host overheads between steps. The figures are an
upper bound to compare targets and settings with, not a promise.
"""

from __future__ import annotations

import dataclasses

from jaxserve.aot.compiler import BucketResult
from jaxserve.aot.targets import AcceleratorTarget


@dataclasses.dataclass(frozen=True)
class StepModel:
    """The per-device figures a step's cost is built from.

    weights_bytes: the weights one device reads each step (MemoryPlan.weights_bytes).
    kv_bytes_per_token: K/V bytes of one token on one device (MemoryPlan.kv_bytes_per_token).
    attention_flops_per_context: FLOPs one token's attention costs per token of context on
        one device: 4 x (N / tp) x H x L (QK^T and PV, 2 FLOPs a multiply-add).
    """

    weights_bytes: int
    kv_bytes_per_token: int
    attention_flops_per_context: float


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """A step's roofline: FLOPs and bytes per device, its time and tokens per second."""

    phase: str  # "decode" | "prefill"
    tokens: int  # real tokens the step computes (= T)
    context: float  # average context a token attends to
    flops: float
    bytes: float
    seconds: float
    bound: str  # "compute" | "memory"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "tokens_per_s": self.tokens_per_s}


def estimate(
    bucket: BucketResult,
    model: StepModel,
    target: AcceleratorTarget,
    phase: str,
    context: int = 0,
) -> StepEstimate | None:
    """The roofline of a compiled step bucket as a ``phase`` step (decode: T sequences at
    ``context`` tokens; prefill: one chunk of T tokens from position 0); None for a bucket
    that did not compile or has no cost analysis."""
    if not bucket.ok or bucket.flops is None or bucket.kind != "step":
        return None
    tokens = bucket.tokens
    if phase == "decode":
        average_context = float(context)
        kv_read = tokens * context * model.kv_bytes_per_token
    elif phase == "prefill":
        average_context = tokens / 2
        kv_read = tokens * model.kv_bytes_per_token  # each page read once per query tile
    else:
        raise ValueError(f"phase must be 'decode' or 'prefill', got {phase!r}")
    flops = bucket.flops + tokens * average_context * model.attention_flops_per_context
    num_bytes = model.weights_bytes + tokens * model.kv_bytes_per_token + kv_read
    compute_s, memory_s = flops / target.peak_flops, num_bytes / target.memory_bandwidth
    return StepEstimate(
        phase=phase,
        tokens=tokens,
        context=average_context,
        flops=flops,
        bytes=num_bytes,
        seconds=max(compute_s, memory_s),
        bound="compute" if compute_s >= memory_s else "memory",
    )
