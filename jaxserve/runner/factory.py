"""build_runner: from an EngineConfig to a loaded model, a sized KV cache and a ModelRunner.

This is where the engine's flat settings meet the device: the model name is resolved (a
built-in name, a folder, or a Hugging Face Hub ID, of which config.json is fetched first), the
execution plan decides every platform question (plan.py: attention, dtype, sampler draw,
buckets), the memory plan (memory_plan.py, the arithmetic of `jaxserve plan`) checks that the
model fits and sizes the KV pool, and only then are the weights fetched and loaded, in the
plan's dtype, each into its sharding. The engine gets back plain host facts (RunnerInfo) plus
the runner.

    build_runner(config)
        resolve_model(config, check_kernels=False) -> ResolvedModel: plan (its attention
                                   kernel not self-checked yet), memory plan, shardings, host
                                   tier size: what loading the weights needs
        start_runner(...):         startup.StartupPipeline, these two overlapped:
          load thread:    _load_weights(resolved) -> LoadedCheckpoint (each weight placed)
          calling thread: resolve_model(config) again, the kernel self-checked (_checked_model);
                          make_runner(resolved, abstract checkpoint) -> ModelRunner (its KV
                          scales, host tier and connector: kv_attachments.py), HostTier | None;
                          use_executable_store(...) (serialized executables in the
                          compilation cache folder); a server's warm-up compiled (warmup=True),
                          or a handed job's set (warmup="job" with job_set: job_startup.py;
                          else per job when it starts: engine/job_warmup.py)
          then the loaded weights in the runner, and each warmed-up step run once
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import jax

from jaxserve.checkpoints_tools import LoadedCheckpoint, TokenizerInfo, load_checkpoint
from jaxserve.checkpoints_tools.orbax_checkpoint import is_orbax_checkpoint
from jaxserve.checkpoints_tools.tokenizer import load_tokenizer
from jaxserve.config import EngineConfig
from jaxserve.core.host_block_pool import HostTier
from jaxserve.models import get_model
from jaxserve.runner.abstract_weights import abstract_checkpoint
from jaxserve.runner.compile_cache import enable_compilation_cache
from jaxserve.runner.draft_model import DraftSpec
from jaxserve.runner.executable_store import fields_of, use_executable_store
from jaxserve.runner.job_startup import JobSetFn, JobStartupWarmup
from jaxserve.runner.kv_attachments import host_tier_of, kv_connector_of, kv_scales_of
from jaxserve.runner.kv_cache import KVAllocator, allocate_kv_caches
from jaxserve.runner.memory_plan import MemoryPlan
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.plan import ExecutionPlan
from jaxserve.runner.resolved_model import ResolvedModel, hub_arguments, resolve_model
from jaxserve.runner.sharding import per_device_bytes, plan_sharding
from jaxserve.runner.startup import StartupPipeline
from jaxserve.runner.warmup import ServerWarmup
from jaxserve.runner.warmup_stages import first_stage
from jaxserve.runner.xla_flags import apply_cpu_workarounds

logger = logging.getLogger("jaxserve")


@dataclass(frozen=True)
class RunnerInfo:
    """Host-side facts the engine needs about the loaded model."""

    config: EngineConfig  # with every "auto" / None resolved
    vocab_size: int
    eos_token_ids: frozenset[int]
    tokenizer: TokenizerInfo
    num_kv_blocks: int  # null block included
    plan: ExecutionPlan
    memory: MemoryPlan | None = None  # None: explicit num_kv_blocks, device memory unknown
    host_tier: HostTier | None = None  # the host KV tier (kv_offloading_size > 0), else None


def replace_tokenizer(ckpt: LoadedCheckpoint, tokenizer: str) -> LoadedCheckpoint:
    """The checkpoint with the tokenizer of another folder (LLM(tokenizer=...)); generation
    stops at the EOS ids of both the model's config and that tokenizer.

    Raises:
        FileNotFoundError: the folder does not exist.
        ValueError: it has no tokenizer.json, or a malformed one (the file is named).
    """
    folder = pathlib.Path(tokenizer)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer={tokenizer!r}: no such folder")
    info = load_tokenizer(folder)
    if info.tokenizer is None:
        raise ValueError(f"tokenizer={tokenizer!r}: {folder / 'tokenizer.json'} not found")
    eos_token_ids = ckpt.eos_token_ids | info.eos_token_ids
    return replace(
        ckpt, tokenizer=replace(info, eos_token_ids=eos_token_ids), eos_token_ids=eos_token_ids
    )


def _compare_weights(runner: ModelRunner, memory: MemoryPlan | None) -> None:
    """Warn when the loaded weights (a draft model's included) take other than the planned
    bytes on a device (the pool was sized with the planned figure)."""
    if memory is None:
        return
    loaded = per_device_bytes(runner.params)
    if runner.draft is not None:
        loaded += per_device_bytes(runner.draft.params)
    if loaded != memory.weights_bytes:
        logger.warning(
            "the loaded weights take %d bytes per device, the memory plan counted %d",
            loaded,
            memory.weights_bytes,
        )


def build_runner(
    config: EngineConfig, job_set: JobSetFn | None = None
) -> tuple[ModelRunner, RunnerInfo]:
    """Check that the model fits, then load the checkpoint (each parameter straight into its
    tensor-parallel sharding) and build the runner over a mesh of `tensor_parallel_size`
    devices; with ``job_set`` (warmup="job": a job handed to the construction,
    job_startup.py), the job's set compiled while the weights load.

    Raises:
        ValueError / FileNotFoundError: bad model name, path or checkpoint (from the loader;
            a Hub ID that does not resolve), revision / download_dir for a built-in model or
            a folder, an unknown backend, max_model_len beyond the model, a model that does
            not fit (memory_plan.MemoryPlan.check: raised before any weight is read), a
            kv_offloading_size that holds no KV block or exceeds the machine's memory
            (kv_offload.host_kv_blocks, also before any weight is read), more
            tensor-parallel devices than there are, a background warm-up on several
            processes (_check_processes).
    """
    apply_cpu_workarounds()  # before jax starts its backends (make_mesh lists the devices)
    _check_processes(config)
    cache_dir = enable_compilation_cache(config.runner.compilation_cache_dir)
    logger.info("compilation cache: %s", cache_dir or "off")
    # All but the attention kernel's self-check, which the weights do not depend on: it runs
    # in this thread while they load (start_runner).
    unchecked = resolve_model(config, check_kernels=False)
    runner, host_tier, ckpt, resolved = start_runner(
        unchecked, cache_dir, lambda: _checked_model(config, unchecked), job_set
    )
    _compare_weights(runner, resolved.memory)
    if host_tier is not None and config.cache.preemption_mode == "auto":
        # "auto" preemption weighs copies against recomputation: measure the copies once.
        bytes_per_s, latency_s = runner.measure_offload_bandwidth()
        host_tier = replace(host_tier, swap_bytes_per_s=bytes_per_s, swap_latency_s=latency_s)
    info = RunnerInfo(
        config=resolved.config,
        vocab_size=ckpt.arch.vocab_size,
        eos_token_ids=ckpt.eos_token_ids,
        tokenizer=ckpt.tokenizer,
        num_kv_blocks=resolved.config.cache.num_kv_blocks,
        plan=resolved.plan,
        memory=resolved.memory,
        host_tier=host_tier,
    )
    return runner, info


def start_runner(
    unchecked: ResolvedModel,
    cache_dir: str | None,
    checked: Callable[[], ResolvedModel],
    job_set: JobSetFn | None = None,
) -> tuple[ModelRunner, HostTier | None, LoadedCheckpoint, ResolvedModel]:
    """The runner with its loaded weights and its executable store, warmed up when it is a
    server's (warmup=True) or has a handed job (``job_set``: its set), and the model resolved
    with its kernel self-checked (``checked()``).
    The weights load (with ``unchecked``'s dtype and shardings) in a thread while the calling
    thread self-checks the kernel, builds the runner over their shapes and compiles
    (startup.py), unless the runner needs their values to be built (_weights_first)."""
    config = unchecked.config

    def make(resolved: ResolvedModel, ckpt: LoadedCheckpoint):
        runner, host_tier = make_runner(resolved, ckpt)
        fields = fields_of(resolved, ckpt.arch)
        use_executable_store(runner, cache_dir, fields, config.runner.precompiled)
        return runner, host_tier

    warmup = _startup_warmup(unchecked, job_set)
    if _weights_first(unchecked):
        resolved = checked()
        ckpt = _load_weights(resolved)
        runner, host_tier = make(resolved, ckpt)
        if warmup is not None:
            warmup.compile(runner, None, ckpt)
            warmup.run(runner)
        return runner, host_tier, ckpt, resolved
    return StartupPipeline(
        load=lambda: _load_weights(unchecked),
        resolve=checked,
        # A handed job's prompts are tokenized before the weights are in (job_startup.py).
        abstract=_abstract_weights if job_set is None else _with_tokenizer,
        make_runner=make,
        compile_all=None if warmup is None else warmup.compile,
        run_once=None if warmup is None else warmup.run,
    ).run()


def _startup_warmup(
    resolved: ResolvedModel, job_set: JobSetFn | None
) -> ServerWarmup | JobStartupWarmup | None:
    """What the construction warms up: a server's set (warmup=True; only its first stage when
    it serves before warm-up ends: engine/background_warmup.py), a handed job's
    (warmup="job" with ``job_set``), else nothing (the job warms up when it starts,
    engine/job_warmup.py; or never)."""
    config, workers = resolved.config, resolved.plan.compile_workers
    if config.runner.warmup is True:
        select = first_stage if config.runner.enable_background_warmup else None
        return ServerWarmup(workers, select)
    if config.runner.warmup == "job" and job_set is not None:
        return JobStartupWarmup(job_set, config, workers)
    return None


def _checked_model(config: EngineConfig, unchecked: ResolvedModel) -> ResolvedModel:
    """``config``'s model with its attention kernel self-checked; the weights loading for
    ``unchecked`` fit it (the check chooses the kernel, never the dtype or the shardings).

    Raises:
        ValueError: with strict_kernels, a kernel that fails its self-check (plan.make_plan).
    """
    resolved = resolve_model(config, source=unchecked.source)
    same = (
        resolved.plan.dtype == unchecked.plan.dtype
        and resolved.config.model.quantization == unchecked.config.model.quantization
        and resolved.sharding.param_shardings() == unchecked.sharding.param_shardings()
    )
    if not same:  # a bug: the weights being loaded are not those this engine needs
        raise RuntimeError("the attention self-check changed the weights' dtype or shardings")
    return resolved


def _check_processes(config: EngineConfig) -> None:
    """Refuse what several processes of one mesh cannot do: their cross-process computations
    must come in the same order in every process, and a background warm-up runs each stage
    between two steps at a time each process finds for itself (engine/background_warmup.py).

    Raises:
        ValueError: enable_background_warmup=True with more than one jax process.
    """
    processes = jax.process_count()
    if config.runner.enable_background_warmup and processes > 1:
        raise ValueError(
            f"enable_background_warmup=True with {processes} jax processes: each process would "
            "run a warm-up stage between two steps at a time of its own, and the processes of "
            "one mesh must run the same computations in the same order; pass "
            "enable_background_warmup=False (the whole warm-up at construction)"
        )


def _weights_first(resolved: ResolvedModel) -> bool:
    """Whether the weights must load before the runner is built: an FP8 KV cache (its scales
    may come from a calibration pass over the weights: kv_attachments.kv_scales_of), a Hub
    model (only its config.json is here yet, not the files that name its EOS ids), or an Orbax
    checkpoint on a mesh over several processes. There every process must issue its
    cross-process computations in the same order; the built-in and Hugging Face loads issue
    none (checkpoint.place), but Orbax's restore synchronises the processes itself (by default
    with jax's sync_global_devices, a computation across every device): in a thread
    beside the calling thread's computations their order would be each process's own timing,
    and two processes that disagree wait on each other until gloo or the coordination service
    times out."""
    fp8 = resolved.plan.kv_cache_dtype.startswith("float8")
    hub = resolved.source != resolved.config.model.model
    return fp8 or hub or (jax.process_count() > 1 and is_orbax_checkpoint(resolved.source))


def _with_tokenizer(resolved: ResolvedModel) -> LoadedCheckpoint:
    return _abstract_weights(resolved, with_tokenizer=True)


def _abstract_weights(resolved: ResolvedModel, with_tokenizer: bool = False) -> LoadedCheckpoint:
    """The checkpoint _load_weights will load, with abstract params (abstract_weights.py) and,
    ``with_tokenizer``, its tokenizer (a handed job's prompts: job_startup.py)."""
    config = resolved.config
    ckpt = abstract_checkpoint(
        resolved.arch,
        resolved.source,
        dtype=resolved.plan.dtype,
        quantization=config.model.quantization,
        shardings=resolved.sharding.param_shardings(),
        with_tokenizer=with_tokenizer,
    )
    if config.model.tokenizer is not None:
        ckpt = replace_tokenizer(ckpt, config.model.tokenizer)
    return ckpt


def _load_draft(resolved: ResolvedModel) -> DraftSpec | None:
    """The draft model, loaded in the plan's dtype on the target's mesh (sharded as its own
    ShardingPlan says)."""
    if resolved.draft_arch is None:
        return None
    spec, plan = resolved.config.speculative, resolved.plan
    model = get_model(resolved.draft_arch, dtype=plan.dtype, attention=plan.attention,
                      max_model_len=resolved.config.model.max_model_len)  # fmt: skip
    sharding = plan_sharding(model, resolved.sharding.mesh)
    ckpt = load_checkpoint(spec.model, dtype=plan.dtype, param_sharding=sharding.param_sharding)
    logger.info("speculative decoding: draft model %s (%s)", spec.model, model)
    return DraftSpec(model, ckpt.params, spec.num_speculative_tokens, sharding)


def _load_weights(resolved: ResolvedModel) -> LoadedCheckpoint:
    """The checkpoint, each weight in the plan's dtype and its sharding (and the tokenizer of
    another folder when one is given)."""
    model_config = resolved.config.model
    ckpt = load_checkpoint(
        model_config.model,
        dtype=resolved.plan.dtype,
        param_sharding=resolved.sharding.param_sharding,
        quantization=model_config.quantization,
        **hub_arguments(resolved.config),
    )
    if model_config.tokenizer is not None:
        ckpt = replace_tokenizer(ckpt, model_config.tokenizer)
    return ckpt


def make_runner(
    resolved: ResolvedModel,
    ckpt: LoadedCheckpoint,
    kv_allocator: KVAllocator = allocate_kv_caches,
    load_draft: Callable[[ResolvedModel], DraftSpec | None] | None = None,
) -> tuple[ModelRunner, HostTier | None]:
    """The ModelRunner of a loaded checkpoint, with its host KV tier when it has one; its KV
    pages made by ``kv_allocator`` (jaxserve/aot: abstract ones, with abstract params), the
    draft model (speculative decoding) by ``load_draft`` (None: its checkpoint loaded)."""
    config, plan = resolved.config, resolved.plan
    model = get_model(
        ckpt.arch,
        dtype=ckpt.dtype,
        attention=plan.attention,
        max_model_len=config.model.max_model_len,
        quantization=ckpt.quantization,
    )
    offload = host_tier_of(model, resolved)
    runner = ModelRunner(
        model,
        ckpt.params,
        num_kv_blocks=config.cache.num_kv_blocks,
        block_size=config.cache.block_size,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_model_len=config.model.max_model_len,
        eos_token_ids=ckpt.eos_token_ids,
        sharding=resolved.sharding,
        plan=plan,
        kv_scales=kv_scales_of(resolved, model, ckpt),
        kv_offload=offload,
        draft=(load_draft or _load_draft)(resolved),
        kv_allocator=kv_allocator,
        kv_connector=kv_connector_of(model, resolved),
    )
    host_tier = None if offload is None else HostTier(resolved.num_host_blocks, offload.block_bytes)
    return runner, host_tier
