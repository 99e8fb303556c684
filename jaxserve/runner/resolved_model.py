"""ResolvedModel: what an engine config resolves to before any weight is read.

``resolve_model`` reads the model's config.json (of a Hub model, config.json is all that is
fetched), makes the execution plan (plan.py), checks the memory plan (memory_plan.py: a model
that cannot fit fails here, before any weight is fetched or read) and plans the shardings and
the host KV tier's size. runner/factory.py builds the runner from it; jaxserve/aot plans for a
chip that is not here with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from jaxserve.checkpoints_tools.hub import CONFIG_FILES
from jaxserve.checkpoints_tools.load import (
    declared_dtype,
    declared_quantization,
    load_arch,
)
from jaxserve.checkpoints_tools.load import (
    resolve_model as resolve_model_source,
)
from jaxserve.checkpoints_tools.quantization import resolve_quantization
from jaxserve.config import EngineConfig
from jaxserve.models import ModelArchConfig, get_model
from jaxserve.pallas_kernels.ragged_paged_attention.impl import AttentionImpl, head_split_refusal
from jaxserve.runner.kv_offload import host_kv_blocks
from jaxserve.runner.machine import Machine
from jaxserve.runner.memory_plan import MemoryPlan, memory_plan_for, resolve_max_model_len
from jaxserve.runner.plan import ExecutionPlan, make_plan
from jaxserve.runner.sharding import ShardingPlan, make_mesh, plan_sharding

logger = logging.getLogger("jaxserve")


@dataclass(frozen=True)
class ResolvedModel:
    """What the engine config resolves to before any weight is read: the plan, the memory
    check, the shardings and the host tier's size (resolve_model)."""

    config: EngineConfig  # with every "auto" / None resolved
    plan: ExecutionPlan
    memory: MemoryPlan | None  # None: explicit num_kv_blocks, device memory unknown
    sharding: ShardingPlan
    num_host_blocks: int  # host KV tier slots; 0: no host tier
    draft_arch: ModelArchConfig | None = None  # speculative decoding's draft model, if any
    arch: ModelArchConfig | None = None  # the model's architecture (its config.json)
    source: str = ""  # where its config.json was read: a folder, or a built-in model's name


def resolve_model(
    config: EngineConfig,
    machine: Machine | None = None,
    check_kernels: bool = True,
    source: str | None = None,
) -> ResolvedModel:
    """The plan, the checked memory plan, the shardings and the host tier's size of
    ``config``'s model, from its architecture alone (of a Hub model, config.json is all that
    is fetched so far): a model that cannot fit fails before any weight is fetched or read,
    and every weight is then loaded once, in the plan's dtype, into its own sharding.

    Args:
        machine: what to plan for (machine.py); None: this process's first devices.
        check_kernels: False: the attention kernel is not self-checked, nothing is logged
            (build_runner: enough to load the weights, while _checked_model checks it).
        source: where config.json is, when resolved before (a ResolvedModel's ``source``):
            a Hub model is not looked up again.

    Raises:
        as build_runner, but nothing about the weights themselves.
    """
    if machine is None:
        machine = Machine.of_mesh(make_mesh(config.runner.tensor_parallel_size))
    model_config = config.model
    config_source = source or resolve_model_source(
        model_config.model, files=CONFIG_FILES, **hub_arguments(config)
    )
    arch = load_arch(config_source)
    plan = make_plan(config, machine, arch, declared_dtype(config_source), check_kernels)
    if check_kernels:
        logger.info("execution plan: %s", plan.summary())
        for reason in plan.attention_refused:
            logger.info("attention: passed over %s", reason)
    max_model_len = resolve_max_model_len(model_config.max_model_len, arch)
    # 8-bit weights: the checkpoint's own (quantization_config) or LLM(quantization=...)'s,
    # quantized while loading; they change the param shapes, so the memory plan and the
    # shardings see them too.
    quantization = resolve_quantization(
        model_config.quantization, declared_quantization(config_source), model_config.model
    )
    draft_arch = _draft_arch(config, arch, plan.attention)
    memory = _checked_memory_plan(
        config, arch, plan, machine, max_model_len, quantization, draft_arch, log=check_kernels
    )
    block_bytes = get_model(arch).kv_cache_bytes_per_block(
        config.cache.block_size, plan.kv_cache_dtype
    )
    num_kv_blocks = config.cache.num_kv_blocks if memory is None else memory.num_kv_blocks
    resolved = replace(
        config,
        model=replace(model_config, max_model_len=max_model_len, quantization=quantization),
        cache=replace(config.cache, num_kv_blocks=num_kv_blocks),
        scheduler=replace(
            config.scheduler, max_model_len=max_model_len, async_scheduling=plan.async_scheduling
        ),  # fmt: skip
        runner=replace(config.runner, attention_backend=plan.attention.name),
    )
    return ResolvedModel(
        config=resolved,
        plan=plan,
        memory=memory,
        sharding=plan_sharding(get_model(arch, quantization=quantization), machine.mesh),
        num_host_blocks=host_kv_blocks(config.cache.kv_offloading_size, block_bytes),
        draft_arch=draft_arch,
        arch=arch,
        source=str(config_source),
    )


def _draft_arch(
    config: EngineConfig, arch: ModelArchConfig, attention: AttentionImpl
) -> ModelArchConfig | None:
    """The draft model's architecture (its config.json only) when speculative decoding uses
    one, checked against the target before any weight is read.

    Raises:
        ValueError: a draft whose vocabulary is not the target's (both named), or whose heads
            the target's attention, run per device under tensor parallelism, cannot split.
    """
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    source = resolve_model_source(spec.model, files=CONFIG_FILES)
    draft = load_arch(source)
    if draft.vocab_size != arch.vocab_size:
        raise ValueError(
            f"speculative_config['model']={spec.model!r} has vocab_size={draft.vocab_size}, the "
            f"target {config.model.model!r} has {arch.vocab_size}: a draft model must share "
            "the target's vocabulary"
        )
    if attention.mesh is not None:
        tp = attention.mesh.shape[attention.axis]
        reason = head_split_refusal(draft.num_heads, draft.num_kv_heads, tp)
        if reason is not None:
            raise ValueError(
                f"speculative_config['model']={spec.model!r} cannot run with attention "
                f"{attention.name!r} at tensor_parallel_size={tp}: {reason}"
            )
    return draft


def _checked_memory_plan(
    config: EngineConfig,
    arch: ModelArchConfig,
    plan: ExecutionPlan,
    machine: Machine,
    max_model_len: int,
    quantization: str | None,
    draft_arch: ModelArchConfig | None = None,
    log: bool = True,
) -> MemoryPlan | None:
    """The memory plan on one device of `machine`, checked: raises before any weight is read
    when the model cannot fit. None when the pool size is explicit and the device reports no
    memory limit (nothing to check against; logged).

    Raises:
        ValueError: the model does not fit (the numbers named).
        RuntimeError: the device reports no memory limit and num_kv_blocks is not given.
    """
    try:
        memory_bytes = machine.device_memory(config.cache.cpu_memory_bytes)
    except RuntimeError as e:
        if config.cache.num_kv_blocks is None:
            raise
        if log:
            logger.warning("%s: not checking that the weights and the KV pool fit", e)
        return None
    memory = memory_plan_for(
        config,
        arch,
        dtype=plan.dtype,
        kv_cache_dtype=plan.kv_cache_dtype,
        max_model_len=max_model_len,
        device_memory_bytes=memory_bytes,
        quantization=quantization,
        draft_arch=draft_arch,
        platform=plan.platform,
    )
    memory.check(config.model.model)
    if not log:
        return memory
    logger.info(
        "memory plan: weights %d bytes, workspace %d bytes, KV %d bytes per token (per device); "
        "%d KV blocks of %d tokens",
        memory.weights_bytes,
        memory.workspace_bytes,
        memory.kv_bytes_per_token,
        memory.num_kv_blocks,
        memory.block_size,
    )
    return memory


def hub_arguments(config: EngineConfig) -> dict[str, Any]:
    return dict(revision=config.model.revision, download_dir=config.model.download_dir)
