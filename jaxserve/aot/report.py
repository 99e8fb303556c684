"""The report of an ahead-of-time compilation: per bucket, totals against the memory plan and
the target, predicted throughput; as a JSON-ready dict and as a table.

Memory, per device (memory_analysis of each compilation): a compilation's live bytes are its
arguments (weights, KV pages, the batch) + outputs - the bytes aliased (the donated KV pages
come back in place) + temporaries, + the engine's resident arrays that are not among its
arguments (the weights and KV pages stay on the device while the sample half or a block copy
runs). The largest over the compilations is set against the memory plan's weights + KV pool +
workspace reserve (+ KV scales) and against the device memory the plan was made with (a TPU's
HBM; a GPU's allocator limit: devices.planning_memory_bytes).
The KV pages alias when every step's aliased bytes cover the pool (donation works).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.aot.compiler import BucketResult
from jaxserve.aot.roofline import StepEstimate, StepModel, estimate
from jaxserve.aot.targets import AcceleratorTarget
from jaxserve.runner.memory_plan import MemoryPlan

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """Everything ``jaxserve compile`` found (``as_dict`` is its JSON)."""

    model: str
    target: AcceleratorTarget
    plan: dict[str, Any]  # ExecutionPlan.as_dict()
    memory: MemoryPlan
    buckets: list[BucketResult]
    step_model: StepModel
    decode_context: int  # tokens of context the decode prediction assumes

    @property
    def steps(self) -> list[BucketResult]:
        return [b for b in self.buckets if b.kind == "step"]

    @property
    def failed(self) -> list[BucketResult]:
        return [b for b in self.buckets if not b.ok]

    @property
    def planned_bytes(self) -> int:
        """The memory plan's bytes per device: weights + KV pool + workspace + KV scales."""
        m = self.memory
        pool = m.num_kv_blocks * m.kv_bytes_per_block
        return m.weights_bytes + pool + m.workspace_bytes + m.kv_scales_bytes

    @property
    def resident_bytes(self) -> int:
        """The plan's arrays on the device for the whole run: weights + KV pool + KV scales."""
        m = self.memory
        return m.weights_bytes + m.num_kv_blocks * m.kv_bytes_per_block + m.kv_scales_bytes

    def live_bytes(self, bucket: BucketResult) -> int | None:
        """The device's bytes while ``bucket`` runs: its own peak, + the resident arrays it
        does not take as arguments (BucketResult.resident_arg_bytes; None: it takes them all)."""
        if bucket.peak_bytes is None:
            return None
        if bucket.resident_arg_bytes is None:
            return bucket.peak_bytes
        return bucket.peak_bytes + max(self.resident_bytes - bucket.resident_arg_bytes, 0)

    @property
    def compiled_peak_bytes(self) -> int | None:
        peaks = [self.live_bytes(b) for b in self.buckets if b.ok and b.peak_bytes is not None]
        return max(peaks) if peaks else None

    @property
    def kv_aliased(self) -> bool:
        """Every compiled step and copy gives the KV pages it takes donated back in place
        (alias >= their bytes; the pool where a result does not say)."""
        pool = self.memory.num_kv_blocks * self.memory.kv_bytes_per_block
        ok = [b for b in self.buckets if b.ok]
        return bool(ok) and all(
            b.memory["alias_size_in_bytes"]
            >= (pool if b.donated_bytes is None else b.donated_bytes)
            for b in ok
        )

    @property
    def fits(self) -> bool:
        peak = self.compiled_peak_bytes
        return peak is not None and peak <= self.memory.device_memory_bytes

    @property
    def ok(self) -> bool:
        return not self.failed and self.fits and self.kv_aliased

    def decode_estimate(self) -> StepEstimate | None:
        """The largest decode batch (a T = R step) whose sequences' context fits the pool."""
        context = self.decode_context
        most = min(self.memory.max_num_seqs, self.memory.max_kv_tokens // max(context, 1))
        decodes = [b for b in self.steps if b.ok and b.tokens == b.rows and b.tokens <= most]
        if not decodes:
            return None
        bucket = self.with_sample(max(decodes, key=lambda b: b.tokens))
        return estimate(bucket, self.step_model, self.target, "decode", context)

    def prefill_estimate(self) -> StepEstimate | None:
        """The largest token bucket as one prefill chunk."""
        plain = [b for b in self.steps if b.ok]
        if not plain:
            return None
        bucket = self.with_sample(max(plain, key=lambda b: b.tokens))
        return estimate(bucket, self.step_model, self.target, "prefill")

    def with_sample(self, step: BucketResult) -> BucketResult:
        """A forward half's result with the FLOPs of the sample half at its R without
        sampling lists added (a whole step's), where that one compiled."""
        for b in self.buckets:
            if b.kind == "sample" and b.ok and b.rows == step.rows and b.sampling_lists == (0, 0):
                return dataclasses.replace(step, flops=(step.flops or 0.0) + (b.flops or 0.0))
        return step

    def totals(self) -> dict[str, Any]:
        peak = self.compiled_peak_bytes
        temps = [b.memory["temp_size_in_bytes"] for b in self.buckets if b.ok]
        planned = self.planned_bytes
        return {
            "num_compilations": len(self.buckets),
            "num_failed": len(self.failed),
            "compile_seconds": sum(b.lower_s + b.compile_s for b in self.buckets),
            "compiled_peak_bytes": peak,
            "max_temp_bytes": max(temps) if temps else None,
            "planned_bytes": planned,
            "planned_workspace_bytes": self.memory.workspace_bytes,
            "compiled_over_planned": None if peak is None else peak / planned,
            "device_memory_bytes": self.memory.device_memory_bytes,
            "chip_memory_bytes": self.target.memory_bytes,
            "fits": self.fits,
            "kv_aliased": self.kv_aliased,
            "ok": self.ok,
        }

    def as_dict(self) -> dict[str, Any]:
        decode, prefill = self.decode_estimate(), self.prefill_estimate()
        return {
            "model": self.model,
            "target": self.target.as_dict(),
            "plan": self.plan,
            "memory_plan": self.memory.as_dict(),
            "step_model": dataclasses.asdict(self.step_model),
            "buckets": [self._bucket_dict(b) for b in self.buckets],
            "totals": self.totals(),
            "decode_context": self.decode_context,
            "predicted": {
                "decode": None if decode is None else decode.as_dict(),
                "prefill": None if prefill is None else prefill.as_dict(),
            },
        }

    def _bucket_dict(self, bucket: BucketResult) -> dict[str, Any]:
        out = bucket.as_dict()
        out["live_bytes"] = self.live_bytes(bucket) if bucket.ok else None
        if bucket.kind == "step":
            phase = "decode" if bucket.tokens == bucket.rows else "prefill"
            est = estimate(self.with_sample(bucket), self.step_model, self.target, phase,
                           self.decode_context)  # fmt: skip
            out["roofline"] = None if est is None else est.as_dict()
        return out
