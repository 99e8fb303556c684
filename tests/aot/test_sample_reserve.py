"""The memory planner's reserve for the step's sample half against what the real TPU compiler
(libtpu, deviceless) allocates for it: the sample half alone, in the sampler variant with the
penalty and ban lists (the one with more temporaries: docs/benchmarks.md), for a tiny Llama
with an 8000-token vocabulary (the sample half's shapes are R, V and the sampler's list widths
only: the model's other sizes do not reach it). Its arguments (the f32 logits, the sampling
lists) and temporaries stay within memory_sizes.sample_workspace_bytes on a v6e-1 (the chip
whose compiler keeps the most of them alive; per chip at tensor parallelism the half is
replicated, the same arrays: bench/aot_check.sh compiles Llama-3.1-8B's for v5e-8).

The reserve is linear in V (R x V x 4 bytes x 17); what the compiler keeps is not a clean law
in V, and at R = 16 it is a larger share of the reserve at a smaller vocabulary (the lists'
arguments do not scale with V, and XLA:TPU kept more [R, V] temporaries): 0.57 of it at 8000
against 0.32 at 32000 (measured 2026-12-05), so the smaller vocabulary leaves the check less
slack, for less compilation (~16 s against ~25 s on a 2-core machine). Skipped without libtpu
(``pip install "jaxserve[tpu]"``)."""

from __future__ import annotations

import pytest
from aot_compilers import require_compiler
from tiny_config import TINY_LLAMA, write_tiny_llama

from jaxserve.aot.abstract_engine import build_abstract_engine
from jaxserve.aot.compiler import compile_job
from jaxserve.aot.targets import get_target
from jaxserve.config import EngineConfig
from jaxserve.models.hf_configs import arch_config_from_hf
from jaxserve.runner.job_shapes import WarmupSet
from jaxserve.runner.memory_sizes import sample_workspace_bytes
from jaxserve.runner.step import SAMPLE_ARGS
from jaxserve.runner.warmup import compilations

VOCAB = 8000
CONFIG = {**TINY_LLAMA, "vocab_size": VOCAB}
ROWS = 16  # max_num_seqs: the largest row bucket


@pytest.fixture(autouse=True)
def _no_mds_query(monkeypatch) -> None:
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")


def test_the_compiled_sample_half_fits_the_planners_reserve(tmp_path) -> None:
    target, tp = "v6e-1", 1
    require_compiler(target)
    model = write_tiny_llama(tmp_path / "model", CONFIG)
    config = EngineConfig.from_kwargs(model=model, tensor_parallel_size=tp, max_model_len=256,
                                      max_num_seqs=ROWS, max_num_batched_tokens=ROWS)  # fmt: skip
    engine = build_abstract_engine(config, get_target(target))
    runner = engine.runner
    shape = max(runner.buckets.all_shapes())  # (T, R, B) with R = ROWS
    assert shape[1] == ROWS
    jobs = compilations(runner, WarmupSet((shape,), runner.sampling.variant_widths, ()))
    samples = [job for job in jobs if tuple(job.names) == SAMPLE_ARGS]
    assert len(samples) == 2  # without and with the sampling lists: the latter compiled
    arch = arch_config_from_hf(CONFIG)
    reserve = sample_workspace_bytes(arch, max_num_seqs=ROWS, platform="tpu")
    assert engine.resolved.memory.workspace_bytes >= reserve
    for job in samples[1:]:
        result = compile_job(job, engine.resolved.sharding.mesh)
        assert result.ok and "lists" in result.label, (result.label, result.error)
        m = result.memory
        # the logits alone are one of the reserve's 17 f32 [R, V] buffers
        assert m["argument_size_in_bytes"] >= ROWS * VOCAB * 4
        assert m["argument_size_in_bytes"] + m["temp_size_in_bytes"] <= reserve, (
            result.label, m, reserve,
        )  # fmt: skip
        assert result.resident_arg_bytes == 0  # no weights, no KV pages: they stay resident
