"""Warm-up: on by default, concurrent compilation (ahead of time, in threads) that the engine's
later calls reuse without compiling again, and failures that leave no thread behind."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLMEngine, SamplingParams
from jaxserve.runner import warmup
from jaxserve.runner.compile_cache import CompileEvents
from jaxserve.runner.input_batch import PreparedBatch
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step_compiles import Compilation, StepCompiles, compile_concurrently
from jaxserve.sampling_params import MAX_BANNED_STOP_TOKEN_IDS

# Steps of up to 16 tokens: 6 forward shapes (17 compilations) instead of 32's 8 (19); longer
# prompts (440 and 297 tokens below) take prefill chunks. tests/engine/test_llm.py's
# test_nothing_compiles_after_warmup builds this engine too: the session's cache compiles it once.
ENGINE = dict(
    num_kv_blocks=48, block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64
)


def _expected_compilations(engine: LLMEngine) -> int:
    """The forward half per (T, R, B) and the sample half per (R, sampler variant), or the
    fused step per (T, R, B, sampler variant) (the CPU's plan), and the block copy per size."""
    runner = engine.runner
    return runner.warmup_set().num_step_compilations(runner.plan.fused_step)


@pytest.mark.slow
def test_warmup_is_on_by_default_and_runs_each_step_once_writing_only_the_null_block(
    monkeypatch,
):
    """The default engine warms up at construction: every step of its set compiled, each run
    once, on rows that attend over the null block only (one engine for both: a whole warm-up
    of this engine is most of a test's time)."""
    ran, widths = [], []
    real_run = ModelRunner.run_prepared

    def run(self, batch, md, *a):
        ran.append(batch)
        widths.append(
            (len(batch.draft_ids), md.penalty_token_ids.shape[1], md.banned_token_ids.shape[1])
        )
        return real_run(self, batch, md, *a)

    monkeypatch.setattr(ModelRunner, "run_prepared", run)
    engine = LLMEngine("tiny-random-llama", **ENGINE)
    stats = engine.get_stats()
    compiled = stats["num_compilations"] + stats["num_compilation_cache_hits"]
    assert compiled == _expected_compilations(engine)
    assert all(c.warmed_up for c in engine.runner.step_compiles())
    runner = engine.runner
    shapes = runner.buckets.all_shapes()
    # Every forward shape and every (R, sampler variant) ran, each step running a new one
    # (fused: every (shape, sampler variant), each once).
    samples = runner.warmup_set().samples
    assert {(len(b.input_ids), *b.block_tables.shape) for b in ran} == set(shapes)
    assert set(widths) == {(r, *w) for r, w in samples}
    copies = {("copy", n) for n in runner.copy_sizes}
    if runner.plan.fused_step:  # the fused shapes' programs, the others' halves
        together, apart = runner.warmup_set().parts()
        assert together.shapes and apart.shapes
        assert runner.warmed == (
            {("fused", *s) for s in together.steps}
            | {("forward", s) for s in apart.shapes}
            | {("sample", r, w) for r, w in apart.samples}
            | copies
        )
    else:
        assert len(ran) <= len(shapes) + len(samples) - len({r for _, r, _ in shapes})
        assert runner.warmed == (
            {("forward", s) for s in shapes} | {("sample", r, w) for r, w in samples} | copies
        )
    # Rows that attend (num_seqs of them), over the null block only.
    assert all(b.num_seqs[0] >= 1 and not b.block_tables.any() for b in ran)
    assert engine.get_stats()["recompilations"] == []  # the runs compiled nothing more
    for k_pages, v_pages in runner.kv_caches:  # [K, S, P, H]: S = 0 is the null block
        for pages in (np.asarray(k_pages), np.asarray(v_pages)):
            assert not pages[:, 1:].any()
            assert pages[:, 0].any()  # the padding tokens' K and V went there
    monkeypatch.undo()
    cold = LLMEngine("tiny-random-llama", warmup=False, **ENGINE)
    assert cold.get_stats()["num_compilations"] == 0
    assert not cold.runner.forward_compiles.warmed_up


@pytest.mark.slow
def test_concurrent_warmup_compiles_each_shape_once_and_the_engine_reuses_them(monkeypatch):
    engine = LLMEngine("tiny-random-llama", warmup=False, **ENGINE)
    runner = engine.runner
    assert runner.warmup(workers=3) == _expected_compilations(engine)
    # Compiled in the threads, then run by the calls without tracing or compiling again; a
    # warm-up whose steps all ran before returns at once (LLM.generate's per-job warm-up on a
    # warm engine), without building a compilation.
    with monkeypatch.context() as m:
        m.setattr(warmup, "compilations", lambda *a: pytest.fail("compilations rebuilt"))
        assert runner.warmup(workers=3) == 0
    before = runner.num_compilations + runner.num_compilation_cache_hits
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, logprobs=2, n=2))
    engine.add_request("b", list(range(3, 30)), SamplingParams(presence_penalty=0.5, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert runner.num_compilations + runner.num_compilation_cache_hits == before
    assert stats["recompilations"] == []


@pytest.mark.parametrize(
    "tokens, rows, width, block_size",
    [(1, 1, 1, 16), (4, 4, 2, 8), (48, 32, 64, 32), (2048, 8, 1, 16), (12, 8, 1, 1), (7, 2, 3, 4)],
)
def test_null_block_batch_rows_are_well_formed_and_touch_only_the_null_block(
    tokens, rows, width, block_size
):
    b = PreparedBatch.null_block(tokens, rows, width, block_size)
    assert len(b.input_ids) == len(b.positions) == len(b.slot_mapping) == tokens
    assert b.block_tables.shape == (rows, width) and not b.block_tables.any()
    real = int(b.num_seqs[0])
    q_lens = np.diff(b.cu_q_lens)
    assert 1 <= real <= rows and (q_lens[:real] >= 1).all() and not q_lens[real:].any()
    assert b.cu_q_lens[-1] <= tokens and not b.kv_lens[real:].any()
    assert (q_lens <= b.kv_lens).all() and (b.kv_lens <= width * block_size).all()
    if tokens > 1 and width * block_size > 1:  # a chunk of several tokens after some context
        assert q_lens[real - 1] > 1 and b.kv_lens[real - 1] > q_lens[real - 1]
    for row in range(real):  # a row's tokens end at its context's last position
        start, end = b.cu_q_lens[row], b.cu_q_lens[row + 1]
        expected = np.arange(b.kv_lens[row] - q_lens[row], b.kv_lens[row])
        np.testing.assert_array_equal(b.positions[start:end], expected)
        assert b.logits_indices[row] == end - 1
    assert (b.slot_mapping < block_size).all()  # block 0's slots


def test_concurrent_compilations_run_in_threads_and_are_reused_by_the_call():
    names = []

    def body(x):
        names.append(threading.current_thread().name)  # runs once per trace
        return jnp.tanh(x) * 2

    fn = jax.jit(body)
    compiles = StepCompiles("body")
    args = [(np.ones(n, np.float32),) for n in (3, 5, 7, 9)]
    before = CompileEvents.in_thread()
    compile_concurrently([Compilation(compiles, fn, a, ("x",)) for a in args], workers=2)
    assert compiles.num_fresh + compiles.num_cache_hits == 4
    # Traced in this thread (under the GIL anyway), compiled in the pool's threads.
    assert names == [threading.current_thread().name] * 4
    assert CompileEvents.in_thread().since(before).compilations == 0
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


class _FakeJitted:
    """A jitted function's ahead-of-time interface whose compile of shape 5 fails (lowering
    succeeds): the failure happens in the pool's threads."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.compiled: list[int] = []

    def lower(self, x):
        def compile_():
            if self.fail and x.shape[0] == 5:
                raise RuntimeError("shape 5 does not compile")
            self.compiled.append(x.shape[0])

        return type("Lowered", (), {"compile": staticmethod(compile_)})()


def test_a_failed_pooled_compilation_is_raised_and_what_did_not_compile_can_compile_again():
    compiles = StepCompiles("fake")
    jobs = [(np.ones(n, np.float32),) for n in range(1, 13)]
    bad = _FakeJitted(fail=True)
    with pytest.raises(RuntimeError, match="shape 5 does not compile"):
        compile_concurrently([Compilation(compiles, bad, a, ("x",)) for a in jobs], workers=2)
    assert not [t for t in threading.enumerate() if t.name.startswith("jaxserve-compile")]
    assert 5 not in bad.compiled and len(bad.compiled) == compiles.num_fresh
    good = _FakeJitted(fail=False)
    compile_concurrently([Compilation(compiles, good, a, ("x",)) for a in jobs], workers=2)
    # Only what had not compiled (the failed shape, and the ones cancelled or never lowered).
    assert sorted(bad.compiled + good.compiled) == list(range(1, 13))
    assert compiles.num_fresh == 12


def test_a_bucket_traces_the_model_once_for_both_sampler_variants(monkeypatch):
    from jaxserve.models import CausalLM

    calls = []
    forward = CausalLM.forward

    def counted(self, *args, **kwargs):
        calls.append(args[2].shape)  # input_ids: i32[T]
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "forward", counted)
    engine = LLMEngine("tiny-random-llama", warmup=False, **ENGINE)
    engine.runner.forward_compiles.store = None  # trace, whatever an earlier engine stored
    shape = engine.runner.buckets.all_shapes()[0]
    # One forward and the sample half in both variants (or the fused step in both), the
    # block copies.
    what = engine.runner.warmup_set([shape])
    assert engine.runner.warmup(shapes=[shape]) == what.num_step_compilations(
        engine.runner.plan.fused_step
    )
    assert calls == [(shape[0],)]


@pytest.mark.slow
def test_the_widest_requests_the_engine_accepts_compile_nothing_after_warm_up():
    """Penalties over every distinct token a request can hold, and min_tokens with the most stop
    ids SamplingParams accepts, run in the shapes warm-up compiled (issue 29, item 13: such
    requests used to compile wider penalty and ban lists mid-run)."""
    engine = LLMEngine("tiny-random-llama", **{**ENGINE, "num_kv_blocks": 80, "max_model_len": 512})
    vocab = engine.runner.vocab_size
    assert engine.runner.sampling.penalty_capacity == min(513, vocab) > 400
    prompt = list(range(3, 3 + 440))  # 440 distinct tokens, past the old 256 and 512 buckets
    engine.add_request("rep", prompt, SamplingParams(repetition_penalty=1.3, max_tokens=72))
    stops = list(range(vocab - MAX_BANNED_STOP_TOKEN_IDS, vocab))
    banned = SamplingParams(min_tokens=6, max_tokens=8, stop_token_ids=stops, temperature=0.8)
    engine.add_request("ban", [5, 6, 7], banned)
    engine.add_request(
        "both",
        list(range(3, 300)),
        SamplingParams(
            presence_penalty=1.0, **{"min_tokens": 3, "max_tokens": 5, "stop_token_ids": stops}
        ),
    )
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats["recompilations"] == []
    assert stats["num_compilations"] + stats["num_compilation_cache_hits"] == (
        _expected_compilations(engine)
    )


def test_a_compilation_after_warm_up_names_the_field_its_old_and_new_shape(caplog):
    """The warning names the one pytree leaf that changed, not every leaf of the argument."""
    from jaxserve.runner.sampling_metadata import SamplingMetadata

    compiles = StepCompiles("the engine step")
    fn = jax.jit(lambda md, x: md.banned_token_ids.sum() + x.sum())
    names = ("sampling_metadata", "x")
    compiles(fn, (SamplingMetadata.neutral(4, 16, ban_width=8), np.zeros(3)), names)
    compiles.warmed_up = True
    with caplog.at_level("WARNING", logger="jaxserve"):
        compiles(fn, (SamplingMetadata.neutral(4, 16, ban_width=16), np.zeros(3)), names)
    (event,) = compiles.events
    assert event["new"] == {"sampling_metadata.banned_token_ids": "int32[4, 16]"}
    assert event["old"] == {"sampling_metadata.banned_token_ids": "int32[4, 8]"}
    (record,) = [r for r in caplog.records if "after warm-up" in r.getMessage()]
    message = record.getMessage()
    assert "sampling_metadata.banned_token_ids: int32[4, 8] -> int32[4, 16]" in message
    assert "top_k" not in message and "warmup=False" in message
