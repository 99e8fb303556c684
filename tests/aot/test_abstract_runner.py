"""The abstract runner (jaxserve/aot/abstract_engine.py's path: factory.make_runner over
jax.ShapeDtypeStruct params and KV pages) puts nothing on a device: a compile-only client
refuses every transfer, so one array made at construction breaks `jaxserve compile` for every
accelerator (it did: async scheduling's last_sampled). Checked here on the CPU, which every
machine has, with jax's transfer guard standing in for the compile-only client; the real
compiles are tests/aot's other modules, where libtpu or the CUDA plugin is installed."""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.aot.abstract_engine import abstract_runner
from jaxserve.checkpoints_tools.hub import CONFIG_FILES
from jaxserve.checkpoints_tools.load import load_arch
from jaxserve.checkpoints_tools.load import resolve_model as resolve_model_source
from jaxserve.config import EngineConfig
from jaxserve.runner.factory import resolve_model
from jaxserve.runner.machine import Machine
from jaxserve.runner.sharding import make_mesh


def _abstract_runner(**kwargs):
    config = EngineConfig.from_kwargs(model="tiny-random-llama", warmup=False, **kwargs)
    arch = load_arch(resolve_model_source("tiny-random-llama", files=CONFIG_FILES))
    # The CPU as a compile-only target would be seen: not attached (no self-check run).
    attached = Machine.of_mesh(make_mesh(1, jax.devices()[:1]))
    machine = dataclasses.replace(attached, attached=False, memory_bytes=1 << 30)
    resolved = resolve_model(config, machine)  # planning may use the default device
    with jax.transfer_guard("disallow_explicit"):  # as a compile-only client: no transfer
        return abstract_runner(resolved, arch, "tiny-random-llama")


def test_the_abstract_runner_allocates_nothing():
    runner = _abstract_runner()
    leaves = jax.tree.leaves((runner.params, runner.kv_caches, runner.last_sampled))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def test_nor_with_a_draft_model_and_fp8_pages():
    spec = {"method": "draft_model", "model": "tiny-random-llama", "num_speculative_tokens": 2}
    runner = _abstract_runner(speculative_config=spec, kv_cache_dtype="fp8")
    assert runner.draft is not None
