"""Compile each of warm-up's compilations for the target, and keep what the compiler says.

The jobs are warmup.compilations(runner, what): the engine's own jitted step halves, the
forward for every (T, R, B) bucket and the sample for every row bucket R in both sampler
variants, the block copy at every padded size, and with a host
KV tier its gather (device -> host) and scatter (host -> device) at every padded size, with a
draft model its proposal at every row bucket and its own block copy, with the arguments warm-up
gives them (abstract params and KV pages here). Each is lowered and compiled
for the target's compile-only devices, one at a time; a failure is recorded (the compiler's
message) and the next job goes on.

Lowering runs under the mesh's abstract mesh (jax.sharding.use_abstract_mesh): Pallas TPU's
lowering asks "which TPU is this" (tpu_info.get_device_kind: the abstract mesh's device, else
jax's default device), and here the default device is the CPU. On the chip itself the default
device answers the same question, so the HLO is the one the engine compiles there.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxserve.runner.draft_model import PROPOSE_ARGS
from jaxserve.runner.kv_offload import GATHER_ARGS, SCATTER_ARGS
from jaxserve.runner.step import COPY_ARGS, FORWARD_ARGS, SAMPLE_ARGS
from jaxserve.runner.step_compiles import Compilation

# memory_analysis() fields kept (bytes per device).
MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
)
_MAX_ERROR_CHARS = 2000
# The copies' kinds, by their arguments' names, and their labels.
_COPY_KINDS = {COPY_ARGS: "copy", GATHER_ARGS: "to_host", SCATTER_ARGS: "from_host"}
_COPY_LABELS = {"copy": "copy", "to_host": "copy to host", "from_host": "copy from host",
                "draft_copy": "draft copy"}  # fmt: skip
_DONATING = ("copy", "from_host")  # the copies that take the pages donated (the gather reads)
# The arguments that are the engine's resident arrays (weights, KV pages: on the device for the
# whole run), by name; the sample half takes none of them, the block copy the pages only.
RESIDENT_ARGS = ("params", "kv_caches", "draft_params", "draft_kv_caches")


@dataclasses.dataclass(frozen=True)
class BucketResult:
    """One compilation's outcome.

    kind: "step" (the step's forward half), "sample" (its sample half), "copy" (copy-on-write),
    "to_host" or "from_host" (the host KV tier's gather and scatter), "draft_propose" or
    "draft_copy" (a draft model's proposal loop and block copy). tokens, rows, width: the step's
    (T, R, B) (rows: the sample's and the proposal's too); sampling_lists: the sample's
    (penalty, ban) list widths, (0, 0) without lists.
    copies: a copy's padded number of blocks. donated_bytes: per device, the KV pages the
    compilation takes donated and must give back in place (0: it donates none; None: not
    known, the pool is expected). resident_arg_bytes: per device, the engine's resident
    arrays (RESIDENT_ARGS: weights, KV pages) among its arguments; the rest of them stay on
    the device while it runs (None: not known, all of them are taken to be arguments).
    memory: MEMORY_FIELDS (bytes per device). flops, bytes_accessed: the compiler's cost
    analysis (per device; a Pallas kernel without a cost estimate counts 0).
    xla_seconds: the compiler's own time estimate ("optimal_seconds"), where it gives one.
    """

    kind: str
    ok: bool
    error: str | None = None
    tokens: int | None = None
    rows: int | None = None
    width: int | None = None
    sampling_lists: tuple[int, int] | None = None
    copies: int | None = None
    donated_bytes: int | None = None
    resident_arg_bytes: int | None = None
    lower_s: float = 0.0
    compile_s: float = 0.0
    memory: dict[str, int] = dataclasses.field(default_factory=dict)
    flops: float | None = None
    bytes_accessed: float | None = None
    xla_seconds: float | None = None

    @property
    def label(self) -> str:
        if self.kind in _COPY_LABELS:
            return f"{_COPY_LABELS[self.kind]} n={self.copies}"
        if self.kind == "draft_propose":
            return f"draft propose R={self.rows}"
        if self.kind == "sample":
            lists = "" if self.sampling_lists == (0, 0) else f" lists={self.sampling_lists}"
            return f"sample R={self.rows}{lists}"
        return f"step T={self.tokens} R={self.rows} B={self.width}"

    @property
    def peak_bytes(self) -> int | None:
        """Live bytes per device while it runs: arguments + outputs - aliased + temporaries."""
        m = self.memory
        if not m:
            return None
        return (
            m["argument_size_in_bytes"]
            + m["output_size_in_bytes"]
            - m["alias_size_in_bytes"]
            + m["temp_size_in_bytes"]
        )

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["label"], out["peak_bytes"] = self.label, self.peak_bytes
        return out


def describe_job(job: Compilation, draft: bool = False) -> dict[str, Any]:
    """What a warm-up compilation is, from its arguments: the step's (T, R, B) and sampler
    lists, a copy's kind and size, or a draft's proposal rows (``draft``: a draft model's job,
    whose block copy is "draft_copy"); and the bytes of KV pages it takes donated."""
    args = dict(zip(job.names, job.args, strict=True))
    if tuple(job.names) == PROPOSE_ARGS:
        return dict(kind="draft_propose", rows=int(args["tokens"].shape[0]),
                    donated_bytes=device_bytes(args["kv_caches"]))  # fmt: skip
    kind = _COPY_KINDS.get(tuple(job.names))
    if kind is not None:
        donated = device_bytes(args["kv_caches"]) if kind in _DONATING else 0
        ids = args["block_ids" if kind != "copy" else "src"]
        return dict(kind="draft_copy" if draft else kind, copies=int(ids.shape[0]),
                    donated_bytes=donated)  # fmt: skip
    if tuple(job.names) == SAMPLE_ARGS:
        sampling = args["sampling_metadata"]
        lists = (int(sampling.penalty_token_ids.shape[1]), int(sampling.banned_token_ids.shape[1]))
        return dict(kind="sample", rows=int(args["logits"].shape[0]), sampling_lists=lists,
                    donated_bytes=0)  # fmt: skip
    if tuple(job.names) != FORWARD_ARGS:
        raise ValueError(f"not a step or a copy compilation: {job.names}")
    return dict(
        kind="step",
        tokens=int(args["input_ids"].shape[0]),
        rows=int(args["logits_indices"].shape[0]),
        width=int(args["attention_metadata"].block_tables.shape[1]),
        donated_bytes=device_bytes((args["kv_caches"], args["draft_kv_caches"])),
    )


def resident_arg_bytes(job: Compilation) -> int:
    """Bytes per device of the engine's resident arrays (RESIDENT_ARGS) among ``job``'s
    arguments."""
    args = dict(zip(job.names, job.args, strict=True))
    return device_bytes([args[name] for name in RESIDENT_ARGS if name in args])


def device_bytes(arrays: Any) -> int:
    """Bytes of ``arrays`` (a pytree of arrays or ShapeDtypeStructs) on one device: each
    leaf's shard under its sharding, the whole leaf without one."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(arrays):
        sharding = getattr(leaf, "sharding", None)
        shape = leaf.shape if sharding is None else sharding.shard_shape(leaf.shape)
        total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    return total


def compile_job(
    job: Compilation,
    mesh: jax.sharding.Mesh,
    draft: bool = False,
    on_compiled: Callable[[Any], None] | None = None,
    on_start: Callable[[str], None] | None = None,
) -> BucketResult:
    """Lower and compile one job for ``mesh``'s devices (``draft``: a draft model's job); a
    failure the compiler raises is a result, not raised. ``on_compiled`` gets the compiled
    executable (jaxserve compile --output keeps it); ``on_start`` the job's label before it
    is lowered (a compiler that aborts the process, XLA's LOG(FATAL), cannot be caught: the
    last label started names the culprit)."""
    facts = describe_job(job, draft)
    facts["resident_arg_bytes"] = resident_arg_bytes(job)
    if on_start is not None:
        on_start(BucketResult(ok=False, **facts).label)
    start = time.perf_counter()
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            lowered = job.fn.lower(*job.args)
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
    except Exception as e:  # the compiler's message is the result
        message = f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]
        return BucketResult(ok=False, error=message, compile_s=time.perf_counter() - start,
                            **facts)  # fmt: skip
    done = time.perf_counter()
    if on_compiled is not None:
        on_compiled(compiled)
    memory = compiled.memory_analysis()
    # XLA:GPU gives no cost analysis of a deviceless compile: then the lowered HLO's, by the
    # CPU client's cost model (the same FLOPs, counted before optimization).
    cost = _cost(compiled) or _hlo_cost(lowered)
    return BucketResult(
        ok=True,
        lower_s=lowered_at - start,
        compile_s=done - lowered_at,
        memory={name: int(getattr(memory, name)) for name in MEMORY_FIELDS},
        flops=cost.get("flops"),
        bytes_accessed=cost.get("bytes accessed"),
        xla_seconds=_non_negative(cost.get("optimal_seconds")),
        **facts,
    )


def _cost(stage: Any) -> dict[str, float]:
    """A compiled or lowered stage's cost_analysis() as one dict (older jax gave a list of one
    per program; {} when there is none)."""
    cost = stage.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return {k: float(v) for k, v in (cost or {}).items() if "{" not in k}


def _non_negative(value: float | None) -> float | None:
    """XLA:TPU's "optimal_seconds" is sometimes negative (no estimate): None then."""
    return value if value is not None and value >= 0 else None


def _hlo_cost(lowered: Any) -> dict[str, float]:
    """The lowered module's cost analysis by the CPU client (XLA's HloCostAnalysis; custom
    calls count 0); {} where this jax lacks the (private, hence guarded) entry point."""
    try:
        from jax._src.lib import xla_client

        module = lowered.compiler_ir("hlo").get_hlo_module()
        cost = xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    except Exception:  # pragma: no cover - depends on the installed jax
        return {}
    return {k: float(v) for k, v in cost.items() if "{" not in k}
