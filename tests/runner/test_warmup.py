"""Warm-up: on by default, concurrent compilation (ahead of time, in threads) that the engine's
later calls reuse without compiling again, and failures that leave no thread behind."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLMEngine, SamplingParams
from jaxserve.runner.compile_cache import CompileEvents
from jaxserve.runner.sampling_metadata import VARIANT_WIDTHS
from jaxserve.runner.step_compiles import Compilation, StepCompiles, compile_concurrently

ENGINE = dict(
    num_kv_blocks=48, block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64
)


def _expected_compilations(engine: LLMEngine) -> int:
    runner = engine.runner
    return len(runner.buckets.all_shapes()) * len(VARIANT_WIDTHS) + len(runner.copy_sizes)


@pytest.mark.slow
def test_warmup_is_on_by_default():
    engine = LLMEngine("tiny-random-llama", **ENGINE)
    stats = engine.get_stats()
    compiled = stats["num_compilations"] + stats["num_compilation_cache_hits"]
    assert compiled == _expected_compilations(engine)
    assert engine.runner.compiles.warmed_up
    cold = LLMEngine("tiny-random-llama", warmup=False, **ENGINE)
    assert cold.get_stats()["num_compilations"] == 0
    assert not cold.runner.compiles.warmed_up


@pytest.mark.slow
def test_concurrent_warmup_compiles_each_shape_once_and_the_engine_reuses_them():
    engine = LLMEngine("tiny-random-llama", warmup=False, **ENGINE)
    runner = engine.runner
    assert runner.warmup(workers=3) == _expected_compilations(engine)
    # Compiled in the threads, then run by the calls without tracing or compiling again.
    assert runner.warmup(workers=3) == 0
    before = runner.num_compilations + runner.num_compilation_cache_hits
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, logprobs=2, n=2))
    engine.add_request("b", list(range(3, 30)), SamplingParams(presence_penalty=0.5, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert runner.num_compilations + runner.num_compilation_cache_hits == before
    assert stats["recompilations"] == []


def test_concurrent_compilations_run_in_threads_and_are_reused_by_the_call():
    names = []

    def body(x):
        names.append(threading.current_thread().name)  # runs once per trace
        return jnp.tanh(x) * 2

    fn = jax.jit(body)
    compiles = StepCompiles("body")
    args = [(np.ones(n, np.float32),) for n in (3, 5, 7, 9)]
    compile_concurrently([Compilation(compiles, fn, a, ("x",)) for a in args], workers=2)
    assert compiles.num_fresh + compiles.num_cache_hits == 4
    assert len(names) == 4 and all(name.startswith("jaxserve-compile") for name in names)
    before = CompileEvents.in_thread()
    for a in args:
        np.testing.assert_allclose(compiles(fn, a, ("x",)), np.tanh(a[0]) * 2, rtol=1e-6)
    # The calls ran the executables compiled in the threads: no trace, no compilation.
    assert len(names) == 4 and CompileEvents.in_thread().since(before).compilations == 0
    assert compiles.num_fresh + compiles.num_cache_hits == 4
    compile_concurrently([Compilation(compiles, fn, args[0], ("x",))], workers=2)
    assert compiles.num_fresh + compiles.num_cache_hits == 4  # seen: skipped


def test_a_failed_compilation_is_raised_and_no_thread_outlives_the_call():
    def body(x):
        if x.shape[0] == 5:
            raise ValueError("shape 5 does not trace")
        return x + 1

    fn = jax.jit(body)
    compiles = StepCompiles("body")
    jobs = [Compilation(compiles, fn, (np.ones(n, np.float32),), ("x",)) for n in range(1, 9)]
    with pytest.raises(ValueError, match="shape 5 does not trace"):
        compile_concurrently(jobs, workers=3)
    alive = [t.name for t in threading.enumerate() if t.name.startswith("jaxserve-compile")]
    assert alive == []
