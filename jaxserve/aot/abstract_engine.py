"""The engine's runner for a named target, with abstract weights and KV pages: what to compile.

``build_abstract_engine(config, target)`` takes the engine's own path as far as it goes
without weights or a device: factory.resolve_model (the execution plan from the target's chip
facts, the memory plan from its memory: the pool the engine would get there, the shardings),
then factory.make_runner with the params as jax.ShapeDtypeStructs in their shardings and the
KV pages from kv_cache.abstract_kv_caches. The ModelRunner so built holds the same jitted step,
buckets and block copy as on the real chip; warmup.compilations(runner, what) lists the
compilations warm-up would run there, and each lowers and compiles for the compile-only
devices (compiler.py). Nothing is allocated and no weight is read: config.json is all.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib

import jax
import jax.numpy as jnp

from jaxserve.aot.devices import compile_devices, planning_memory_bytes
from jaxserve.aot.targets import AcceleratorTarget, chip_facts
from jaxserve.checkpoints_tools import LoadedCheckpoint, TokenizerInfo
from jaxserve.checkpoints_tools.hub import CONFIG_FILES
from jaxserve.checkpoints_tools.load import load_arch
from jaxserve.checkpoints_tools.load import resolve_model as resolve_model_source
from jaxserve.checkpoints_tools.tokenizer import load_tokenizer
from jaxserve.config import EngineConfig
from jaxserve.models import ModelArchConfig, get_model
from jaxserve.runner.factory import ResolvedModel, make_runner, resolve_model
from jaxserve.runner.kv_cache import abstract_kv_caches
from jaxserve.runner.machine import Machine
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.sharding import make_mesh

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass(frozen=True)
class AbstractEngine:
    """The engine of ``resolved.config`` as it would be built on ``target``, weightless.

    runner: a ModelRunner over abstract params and KV pages: compile its steps, never run them.
    """

    target: AcceleratorTarget
    resolved: ResolvedModel
    arch: ModelArchConfig
    runner: ModelRunner


def target_machine(target: AcceleratorTarget, tensor_parallel_size: int) -> Machine:
    """The target's compile-only devices as a Machine (its chip facts and memory).

    Raises:
        devices.CompilerMissing / ValueError: as devices.compile_devices.
    """
    devices = compile_devices(target, tensor_parallel_size)
    return Machine(
        mesh=make_mesh(tensor_parallel_size, devices),
        chip=chip_facts(target),
        memory_bytes=planning_memory_bytes(target),
        attached=False,
    )


def build_abstract_engine(config: EngineConfig, target: AcceleratorTarget) -> AbstractEngine:
    """The engine of ``config`` on ``target``, from the model's config.json alone.

    Raises:
        ValueError: a setting ahead-of-time compilation does not cover (named), or what the
            engine itself would refuse (a model that does not fit, a bad flag, ...).
        devices.CompilerMissing: the target's compiler is not installed.
    """
    _refuse_unsupported(config)
    source = resolve_model_source(  # a model that cannot be read fails before any compiler
        config.model.model,
        files=CONFIG_FILES,
        revision=config.model.revision,
        download_dir=config.model.download_dir,
    )
    arch = load_arch(source)
    machine = target_machine(target, config.runner.tensor_parallel_size)
    resolved = resolve_model(config, machine)
    ckpt = _abstract_checkpoint(resolved, arch, source)
    runner, _ = make_runner(resolved, ckpt, kv_allocator=abstract_kv_caches)
    return AbstractEngine(target=target, resolved=resolved, arch=arch, runner=runner)


def _refuse_unsupported(config: EngineConfig) -> None:
    """Settings whose device state cannot be abstract yet: refused, never dropped."""
    if config.cache.kv_offloading_size:
        raise ValueError(
            f"kv_offloading_size={config.cache.kv_offloading_size}: the host KV tier's copies "
            "are not compiled ahead of time yet; compile without it (0)"
        )
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":
        raise ValueError(
            "speculative_config method 'draft_model': a draft model's steps are not compiled "
            "ahead of time yet; compile without it, or with method 'ngram'"
        )


def _abstract_checkpoint(
    resolved: ResolvedModel, arch: ModelArchConfig, source: str
) -> LoadedCheckpoint:
    """A LoadedCheckpoint whose params are jax.ShapeDtypeStructs in their shardings (the
    plan's dtype and quantization), with the folder's EOS ids (they size the sampler's ban
    lists) and no tokenizer."""
    config, plan = resolved.config, resolved.plan
    quantization = config.model.quantization
    model = get_model(arch, dtype=plan.dtype, quantization=quantization)
    params = jax.tree_util.tree_map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        model.param_shapes(),
        resolved.sharding.param_shardings(),
    )
    folder = pathlib.Path(source)
    if folder.is_dir():
        tokenizer = load_tokenizer(folder)
        tokenizer = dataclasses.replace(tokenizer, tokenizer=None)
    else:  # a built-in model
        tokenizer = TokenizerInfo(None, eos_token_ids=frozenset(arch.eos_token_ids))
    return LoadedCheckpoint(
        arch=arch,
        params=params,
        dtype=jnp.dtype(plan.dtype),
        eos_token_ids=tokenizer.eos_token_ids,
        max_position_embeddings=arch.max_position_embeddings,
        tokenizer=tokenizer,
        path=str(folder) if folder.is_dir() else None,
        quantization=quantization,
    )
