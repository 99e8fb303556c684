"""The execution plan: every platform decision, made once when the engine is built.

    platform and chip       cpu / gpu (by generation: Blackwell+, Hopper, Ampere/Ada, older) / tpu
    attention               an AttentionImpl from the registry (pallas_kernels/.../registry.py),
                            checked once per process against the reference on a small batch
    sampler draw            the C++ kernel on the CPU where it builds, XLA elsewhere
    dtype                   "auto": the checkpoint's; float32 checkpoints run in bfloat16 on
                            GPU and TPU (as vLLM does), stay float32 on the CPU
    KV cache dtype          the model dtype, or FP8 (float8_e4m3fn / float8_e5m2) when the
                            config asks for it: then attention is only chosen among the
                            implementations that read FP8 pages (kernels.KernelSpec.fp8_kv)
    buckets, RoPE rows      the CPU's extra token buckets (1 and 3 * 2^k) and host-gathered
                            RoPE rows; accelerators compute RoPE on device
    tensor parallelism      the mesh; attention runs per device inside shard_map
    step programs           the step's forward and sample halves as two jitted programs;
                            JAXSERVE_FUSED_STEP=1 fuses them into one for the decode buckets
                            (fused_step.py; off by default everywhere)
    warm-up threads         compilations at once: 1 on the CPU (XLA's CPU compiler already
                            spreads one compilation over the cores: two at once measured no
                            faster on 2 cores), up to 4 on accelerators (host-side compiles)
    grammar fill threads    the grammar masks' batch fill (structured/batch_fill.py): half
                            the CPUs, 2-8; none on one CPU (MAX_GRAMMAR_FILL_THREADS)

Nothing below the plan asks which platform it runs on: the model gets the attention object,
the sampler gets the draw's name, the runner reads the bucket and RoPE flags.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, kv_cache_storage_dtype
from jaxserve.models import TP_AXIS, ModelArchConfig
from jaxserve.pallas_kernels.ragged_paged_attention import (
    AttentionImpl,
    Target,
    auto_order,
    cpu_rows,
    ragged_paged_attention_reference,
    select_attention,
)
from jaxserve.pallas_kernels.ragged_paged_attention.kv_quant import is_fp8, quantize
from jaxserve.pallas_kernels.ragged_paged_attention.testing import random_batch
from jaxserve.pallas_kernels.sampling import cpu_draw
from jaxserve.runner import map_budget
from jaxserve.runner.machine import Machine

logger = logging.getLogger("jaxserve")

# Async scheduling by platform, when the config leaves it to the plan. On an accelerator the
# host's per-step work (scheduling, inputs, outputs) otherwise leaves the device idle between
# steps; on the CPU the "device" is the same cores the host work runs on (docs/benchmarks.md).
ASYNC_SCHEDULING = {"cpu": True, "gpu": True, "tpu": True}
# When async scheduling runs a step ahead, where the config leaves it to the plan: always, or as
# measured (engine/run_ahead.py: on the CPU the overlap competes with the step for the cores;
# the 57M model at 256 decodes lost 2-3% running ahead, the demo model gained 1.1-1.5x).
RUN_AHEAD = {"cpu": "measured", "gpu": "always", "tpu": "always"}

# The step's two halves fused into one jitted program for its decode-shaped buckets
# (fused_step.py, job_shapes.fused_shape), by platform. Off everywhere: on the CPU a fused
# decode step ran 1.14-1.19x faster on the demo model (a second launch and the logits' round
# trip cost the split), but each fused program compiles the sampler again, and warm-up-heavy
# work took 1.35x as long (test_generate_parity + test_warmup: 96.7 s against 71.4 s split),
# against a 57M throughput within noise (docs/benchmarks.md, "The step: fused or split"); an
# accelerator launches asynchronously, and the split lets the token masks overlap the forward.
FUSED_STEP = {"cpu": False, "gpu": False, "tpu": False}
FUSED_STEP_ENV = "JAXSERVE_FUSED_STEP"  # "1" / "0": fused / split whatever the platform

# The threads that fill a step's grammar masks in one call (structured/batch_fill.py): half the
# CPUs this process may use, at least 2 and at most 8; none (row by row on the engine thread) on
# a single CPU. The engine thread waits for the pool with the GIL released, so one pool thread
# would only hand the work over; beyond 4 CPUs half stay with the runtime (the device's launches,
# a CPU backend's compute, the server's threads). On 2 cores two threads left the device idle
# 0.04-0.14 ms before a constrained step against 0.19-0.24 row by row; the throughput of the
# two measured the same within the noise there, where the forward the fill overlaps runs on the
# same cores (docs/benchmarks.md, "The grammar fill's threads on the CPU").
MAX_GRAMMAR_FILL_THREADS = 8

# Largest |kernel - reference| accepted by the self-check, per dtype (outputs are O(1)).
_SELF_CHECK_TOLERANCE = {"float32": 2e-3, "bfloat16": 6e-2, "float16": 1e-2}


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    """Every platform decision of one engine (see the module docstring)."""

    platform: str  # "cpu" | "gpu" | "tpu"
    device_kind: str  # e.g. "NVIDIA H200", "TPU v5 lite", "cpu"
    gpu_generation: str | None  # target.BLACKWELL / HOPPER / AMPERE / OLDER_GPU on "gpu"
    attention: AttentionImpl
    attention_refused: tuple[str, ...]  # why "auto" passed over each implementation before it
    sampler_draw: str  # "cpu" | "xla" (draw.DRAWS)
    dtype: str  # params and activations
    kv_cache_dtype: str  # of the KV pages: dtype, or "float8_e4m3fn" / "float8_e5m2"
    tensor_parallel_size: int
    host_rope: bool  # RoPE cos / sin rows gathered on the host into AttentionMetadata
    mid_token_buckets: bool  # token buckets at 3 * 2^k too (buckets.py)
    single_token_bucket: bool  # a T=1 bucket below the smallest power of two
    compile_workers: int = 1  # warm-up compilations at once (ModelRunner.warmup)
    # The attention kernel was self-checked against the reference on the device (False: the
    # plan is for a chip that is not attached, e.g. an ahead-of-time target; Machine.attached).
    attention_checked: bool = True
    # Compiled executables the engine may hold (the CPU's memory-map budget: map_budget.py);
    # None: no budget (GPU, TPU).
    max_executables: int | None = None
    # Schedule the next step while the device runs this one (the config's, or by platform:
    # ASYNC_SCHEDULING).
    async_scheduling: bool = False
    # With async scheduling: run ahead "always", or when "measured" faster (RUN_AHEAD).
    run_ahead: str = "always"
    # The step as one jitted program per (T, R, B, sampler variant) instead of a forward per
    # (T, R, B) and a sample per (R, sampler variant) (FUSED_STEP).
    fused_step: bool = False
    # Threads of the grammar masks' batch fill; 0: row by row on the engine thread
    # (MAX_GRAMMAR_FILL_THREADS).
    grammar_fill_threads: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain values (get_stats()["plan"])."""
        out = dataclasses.asdict(self)
        out["attention"] = self.attention.name
        out["attention_interpret"] = self.attention.interpret
        out["attention_soft_fp8"] = self.attention.soft_fp8
        out["attention_refused"] = list(self.attention_refused)
        return out

    def summary(self) -> str:
        chip = self.device_kind + (f", {self.gpu_generation}" if self.gpu_generation else "")
        mode = " (interpret mode)" if self.attention.interpret else ""
        if self.attention.soft_fp8:
            mode += " (e4m3 pages converted with integer ops)"
        return (
            f"platform={self.platform} ({chip}), attention={self.attention.name}{mode}, "
            f"sampler_draw={self.sampler_draw}, dtype={self.dtype}, "
            f"kv_cache_dtype={self.kv_cache_dtype}, tensor_parallel_size="
            f"{self.tensor_parallel_size}, async_scheduling={self.async_scheduling} (run ahead: "
            f"{self.run_ahead}), "
            f"fused_step={self.fused_step}"
        )


def resolve_dtype(requested: str, declared: str | None, platform: str) -> str:
    """The model dtype: an explicit one as given; "auto" the checkpoint's own (float32 when it
    declares none we run), except that float32 becomes bfloat16 on GPU and TPU."""
    if requested != "auto":
        return requested
    dtype = declared if declared in ("float32", "bfloat16", "float16") else "float32"
    return "bfloat16" if dtype == "float32" and platform != "cpu" else dtype


def _target(
    config: EngineConfig, arch: ModelArchConfig, dtype: str, kv_cache_dtype: str, facts: dict
) -> Target:
    """What the attention registry chooses for: the model's heads, the pages, the chip."""
    return Target(
        dtype=dtype,
        num_q_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        page_size=config.cache.block_size,
        # The local layers' window (full-attention layers need nothing more of a kernel).
        sliding_window=arch.sliding_window,
        soft_cap=arch.attn_logit_softcap,
        tensor_parallel_size=config.runner.tensor_parallel_size,
        kv_cache_dtype=None if kv_cache_dtype == dtype else kv_cache_dtype,
        **facts,
    )


def make_plan(
    config: EngineConfig,
    mesh: jax.sharding.Mesh | Machine,
    arch: ModelArchConfig,
    declared_dtype: str | None,
    check_kernels: bool = True,
) -> ExecutionPlan:
    """Decide everything for this engine on this mesh (of this process's devices) or machine
    (machine.py: also a chip that is not attached, from its facts alone; its kernel is then
    not self-checked, since nothing can run it here).

    Args:
        declared_dtype: the dtype the checkpoint declares (its config), or None.
        check_kernels: False: the attention kernel is not self-checked (a plan to start
            loading the weights with, which depend on its dtype only: factory.build_runner
            makes the checked one while they load).

    Raises:
        ValueError: an attention_backend that cannot run here (the message lists those that
            can); with strict_kernels, a kernel that fails its self-check.
    """
    machine = mesh if isinstance(mesh, Machine) else Machine.of_mesh(mesh)
    mesh, facts = machine.mesh, machine.chip
    platform = facts["platform"]
    dtype = resolve_dtype(config.model.dtype, declared_dtype, platform)
    kv_cache_dtype = kv_cache_storage_dtype(config.cache.kv_cache_dtype, dtype)
    tp = config.runner.tensor_parallel_size
    target = _target(config, arch, dtype, kv_cache_dtype, facts)
    attention, refused = select_attention(config.runner.attention_backend, target)
    if machine.attached and check_kernels:
        attention, refused = _checked(attention, refused, target, config)
    elif not machine.attached:
        logger.info("attention %s not self-checked: no %s attached", attention.name, target.where)
    if platform == "cpu" and attention.kernel != "cpu" and check_kernels:
        _warn_unbuilt(cpu_rows.unavailable_reason(), "attention", attention.name)
    if tp > 1:
        attention = dataclasses.replace(attention, mesh=mesh, axis=TP_AXIS)
    on_cpu = platform == "cpu"
    return ExecutionPlan(
        platform=platform,
        device_kind=str(facts["device_kind"]),
        gpu_generation=target.gpu_generation,
        attention=attention,
        attention_refused=tuple(refused),
        sampler_draw=_sampler_draw(platform),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tp,
        host_rope=on_cpu,
        mid_token_buckets=on_cpu,
        single_token_bucket=on_cpu,
        compile_workers=1 if on_cpu else max(1, min(4, os.cpu_count() or 1)),
        attention_checked=machine.attached and check_kernels,
        max_executables=map_budget.max_executables() if on_cpu else None,
        async_scheduling=_async_scheduling(config.scheduler.async_scheduling, platform),
        run_ahead=_run_ahead(config.scheduler.async_scheduling, platform),
        fused_step=fused_step(platform),
        grammar_fill_threads=grammar_fill_threads(),
    )


def _async_scheduling(requested: bool | None, platform: str) -> bool:
    """The config's choice, else the platform's (ASYNC_SCHEDULING)."""
    return ASYNC_SCHEDULING[platform] if requested is None else requested


def _run_ahead(requested: bool | None, platform: str) -> str:
    """ "always" when the config chose async scheduling itself, else the platform's
    (RUN_AHEAD)."""
    return RUN_AHEAD[platform] if requested is None else "always"


def fused_step(platform: str) -> bool:
    """Whether the step runs as one fused program on ``platform`` (FUSED_STEP), unless
    JAXSERVE_FUSED_STEP says "1" or "0".

    Raises:
        ValueError: JAXSERVE_FUSED_STEP set to anything else.
    """
    value = os.environ.get(FUSED_STEP_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{FUSED_STEP_ENV} must be 0 or 1 (or unset), got {value!r}")
    return FUSED_STEP[platform] if not value else value == "1"


def grammar_fill_threads() -> int:
    """The grammar fill's threads here: half the CPUs this process may use, from 2 up to
    MAX_GRAMMAR_FILL_THREADS; 0 on one CPU."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = (len(affinity(0)) if affinity is not None else os.cpu_count()) or 1
    return 0 if cpus < 2 else min(MAX_GRAMMAR_FILL_THREADS, max(2, cpus // 2))


def _sampler_draw(platform: str) -> str:
    if platform != "cpu":
        return "xla"
    if cpu_draw.available():
        return "cpu"
    _warn_unbuilt(cpu_draw.KERNEL.unavailable_reason(), "sampling draw", "xla")
    return "xla"


def _warn_unbuilt(reason: str | None, what: str, instead: str) -> None:
    """One warning for a C++ CPU kernel that did not build (nothing when it built, or when it
    was switched off on purpose, JAXSERVE_CPU_KERNEL=0)."""
    if reason is None:
        return
    log = logger.info if reason.startswith("disabled") else logger.warning
    log("the C++ CPU kernel for the %s is not used (%s): running %s instead", what, reason, instead)


def _checked(
    attention: AttentionImpl,
    refused: list[str],
    target: Target,
    config: EngineConfig,
) -> tuple[AttentionImpl, list[str]]:
    """The chosen kernel after its self-check; on a mismatch, the next implementation of the
    platform's "auto" order (logged, naming both), or a ValueError when strict_kernels."""
    while True:
        error = self_check(attention, target)
        if error is None:
            return attention, refused
        message = f"attention {attention.name} disagrees with the reference here ({error})"
        if config.runner.strict_kernels:
            raise ValueError(f"{message}; strict_kernels=True")
        order = auto_order(target)
        rest = order[order.index(attention.name) + 1 :] if attention.name in order else order
        fallback, more = select_attention("auto", target, order=rest)
        logger.warning("%s: using %s instead", message, fallback.name)
        attention, refused = fallback, [*refused, message, *more]


@functools.cache
def self_check(attention: AttentionImpl, target: Target) -> str | None:
    """Run ``attention`` once on a small ragged batch of decodes and prefill chunks (the
    target's heads, head dim, page size, dtype and options; FP8 pages with scales when the
    target's KV cache is FP8) against the reference; the error found, or None. Cached per
    process. Plain XLA implementations and interpret mode are trusted (the reference's own
    ops; tests cover interpret mode)."""
    if attention.kernel in ("reference", "xla") or attention.interpret:
        return None
    seqs = [(1, 5), (1, 40), (7, 30), (1, 64), (20, 20)]  # decodes and prefill chunks
    page_size = target.page_size
    batch = random_batch(
        seqs,
        num_tokens=32,
        num_slots=8,
        table_width=-(-64 // page_size),
        num_q_heads=target.num_q_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        page_size=page_size,
        dtype=jnp.dtype(target.dtype),
        rng=np.random.default_rng(0),
    )
    options = dict(
        sm_scale=target.head_dim**-0.5,
        sliding_window=target.sliding_window,
        soft_cap=target.soft_cap,
    )
    if is_fp8(target.kv_dtype):
        # The same FP8 pages (and scales) for both: the kernel's dequantization is checked.
        q, k_pages, v_pages, *metadata = batch
        scales = dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(2.0))
        k_pages = quantize(k_pages, scales["k_scale"], target.kv_dtype)
        v_pages = quantize(v_pages, scales["v_scale"], target.kv_dtype)
        batch = (q, k_pages, v_pages, *metadata)
        options.update(scales)
    try:
        got = jax.jit(functools.partial(attention, **options))(*batch)
        want = jax.jit(functools.partial(ragged_paged_attention_reference, **options))(*batch)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    except Exception as e:  # a kernel that fails to compile or run here
        return f"{type(e).__name__}: {e}"
    tolerance = _SELF_CHECK_TOLERANCE[target.dtype]
    if not err <= tolerance:
        return f"max abs error {err:.3g} > {tolerance:g}"
    return None
