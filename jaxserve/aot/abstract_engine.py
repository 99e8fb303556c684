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

from jaxserve.aot.devices import compile_devices, planning_memory_bytes
from jaxserve.aot.targets import AcceleratorTarget, chip_facts
from jaxserve.checkpoints_tools import LoadedCheckpoint
from jaxserve.checkpoints_tools.hub import CONFIG_FILES
from jaxserve.checkpoints_tools.load import load_arch
from jaxserve.checkpoints_tools.load import resolve_model as resolve_model_source
from jaxserve.config import EngineConfig
from jaxserve.models import ModelArchConfig, get_model
from jaxserve.runner.abstract_weights import abstract_checkpoint, abstract_params
from jaxserve.runner.draft_model import DraftSpec
from jaxserve.runner.factory import ResolvedModel, make_runner, resolve_model
from jaxserve.runner.kv_cache import abstract_kv_caches
from jaxserve.runner.machine import Machine
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.sharding import make_mesh, plan_sharding

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
        ValueError: what the engine itself would refuse (a model that does not fit, a bad
            flag, ...).
        devices.CompilerMissing: the target's compiler is not installed.
    """
    source = resolve_model_source(  # a model that cannot be read fails before any compiler
        config.model.model,
        files=CONFIG_FILES,
        revision=config.model.revision,
        download_dir=config.model.download_dir,
    )
    arch = load_arch(source)
    machine = target_machine(target, config.runner.tensor_parallel_size)
    resolved = resolve_model(config, machine)
    runner = abstract_runner(resolved, arch, source)
    return AbstractEngine(target=target, resolved=resolved, arch=arch, runner=runner)


def abstract_runner(resolved: ResolvedModel, arch: ModelArchConfig, source: str) -> ModelRunner:
    """The runner of ``resolved`` over abstract params and KV pages (the model ``arch``, read
    from ``source``): nothing is allocated on its devices or transferred to them, which a
    compile-only client would refuse."""
    ckpt = _abstract_checkpoint(resolved, arch, source)
    runner, _ = make_runner(
        resolved, ckpt, kv_allocator=abstract_kv_caches, load_draft=_abstract_draft
    )
    return runner


def _abstract_draft(resolved: ResolvedModel) -> DraftSpec | None:
    """Speculative decoding's draft model as factory._load_draft makes it (its plan's dtype and
    attention, its own ShardingPlan on the target's mesh), with abstract params: its config.json
    was read by resolve_model (resolved.draft_arch), its weights never are."""
    if resolved.draft_arch is None:
        return None
    plan, config = resolved.plan, resolved.config
    model = get_model(resolved.draft_arch, dtype=plan.dtype, attention=plan.attention,
                      max_model_len=config.model.max_model_len)  # fmt: skip
    sharding = plan_sharding(model, resolved.sharding.mesh)
    params = abstract_params(model, sharding.param_shardings())
    return DraftSpec(model, params, config.speculative.num_speculative_tokens, sharding)


def _abstract_checkpoint(
    resolved: ResolvedModel, arch: ModelArchConfig, source: str
) -> LoadedCheckpoint:
    """A LoadedCheckpoint whose params are jax.ShapeDtypeStructs in their shardings (the
    plan's dtype and quantization), with the folder's EOS ids (they size the sampler's ban
    lists) and no tokenizer (runner/abstract_weights.py)."""
    return abstract_checkpoint(
        arch,
        source,
        dtype=resolved.plan.dtype,
        quantization=resolved.config.model.quantization,
        shardings=resolved.sharding.param_shardings(),
    )
