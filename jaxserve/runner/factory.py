"""build_runner: from an EngineConfig to a loaded model, a sized KV cache and a ModelRunner.

This is where the engine's flat settings meet the device: the execution plan decides every
platform question (plan.py: attention, dtype, sampler draw, buckets), the checkpoint is loaded
in the plan's dtype, the remaining "auto" choices are resolved (max_model_len, pool size), and
the KV pool is sized. The engine gets back plain host facts (RunnerInfo) plus the runner.
"""

from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass, replace

from jaxserve.checkpoints_tools import LoadedCheckpoint, TokenizerInfo, load_checkpoint
from jaxserve.checkpoints_tools.load import declared_dtype, load_arch
from jaxserve.checkpoints_tools.tokenizer import load_tokenizer
from jaxserve.config import EngineConfig
from jaxserve.models import CausalLM, get_model
from jaxserve.runner.kv_cache import device_memory_bytes, num_blocks_for_budget
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.plan import ExecutionPlan, make_plan
from jaxserve.runner.sharding import ShardingPlan, make_mesh, per_device_bytes, plan_sharding
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


def resolve_max_model_len(requested: int | None, ckpt: LoadedCheckpoint) -> int:
    limit = ckpt.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}"
        )
    return requested


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


def _num_kv_blocks(
    config: EngineConfig,
    model: CausalLM,
    ckpt: LoadedCheckpoint,
    plan: ShardingPlan,
    max_model_len: int,
) -> int:
    """The configured pool size, or what fits in one device's memory budget next to that
    device's share of the weights (under TP every device holds the same share)."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    device = plan.mesh.devices.flat[0]
    blocks_per_seq = -(-max_model_len // cache.block_size)
    return num_blocks_for_budget(
        budget_bytes=int(
            device_memory_bytes(device, cache.cpu_memory_bytes) * cache.memory_utilization
        ),
        weights_bytes=per_device_bytes(ckpt.params),
        bytes_per_block=plan.kv_bytes_per_block(model, cache.block_size, ckpt.dtype),
        max_useful_blocks=config.scheduler.max_num_seqs * blocks_per_seq + 1,
    )


def build_runner(config: EngineConfig) -> tuple[ModelRunner, RunnerInfo]:
    """Load the checkpoint (each parameter straight into its tensor-parallel sharding) and
    build the runner over a mesh of `tensor_parallel_size` devices.

    Raises:
        ValueError / FileNotFoundError: bad model path or checkpoint (from the loader), an
            unknown backend, max_model_len beyond the model, a KV pool that cannot fit, more
            tensor-parallel devices than there are.
    """
    apply_cpu_workarounds()  # before jax starts its backends (make_mesh lists the devices)
    mesh = make_mesh(config.runner.tensor_parallel_size)
    # The architecture (config only) decides the plan and the shardings before any weight is
    # read, so that every weight is loaded once, in the plan's dtype, into its own sharding.
    arch = load_arch(config.model.model)
    plan = make_plan(config, mesh, arch, declared_dtype(config.model.model))
    logger.info("execution plan: %s", plan.summary())
    for reason in plan.attention_refused:
        logger.info("attention: passed over %s", reason)
    sharding = plan_sharding(get_model(arch), mesh)
    ckpt = load_checkpoint(
        config.model.model, dtype=plan.dtype, param_sharding=sharding.param_sharding
    )
    if config.model.tokenizer is not None:
        ckpt = replace_tokenizer(ckpt, config.model.tokenizer)
    max_model_len = resolve_max_model_len(config.model.max_model_len, ckpt)
    model = get_model(ckpt.arch, dtype=ckpt.dtype, attention=plan.attention)
    cache = config.cache
    num_kv_blocks = _num_kv_blocks(config, model, ckpt, sharding, max_model_len)
    resolved = replace(
        config,
        model=replace(config.model, max_model_len=max_model_len),
        cache=replace(cache, num_kv_blocks=num_kv_blocks),
        scheduler=replace(config.scheduler, max_model_len=max_model_len),
        runner=replace(config.runner, attention_backend=plan.attention.name),
    )
    runner = ModelRunner(
        model,
        ckpt.params,
        num_kv_blocks=num_kv_blocks,
        block_size=cache.block_size,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_ids=ckpt.eos_token_ids,
        sharding=sharding,
        plan=plan,
    )
    if config.runner.warmup:
        runner.warmup()
    info = RunnerInfo(
        config=resolved,
        vocab_size=ckpt.arch.vocab_size,
        eos_token_ids=ckpt.eos_token_ids,
        tokenizer=ckpt.tokenizer,
        num_kv_blocks=num_kv_blocks,
        plan=plan,
    )
    return runner, info
