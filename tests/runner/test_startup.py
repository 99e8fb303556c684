"""Start-up (runner/startup.py): the weights load in a thread while the runner is built over
their shapes and a server's warm-up compiles; failures on either side surface, and no thread
outlives the engine's construction. Orders are checked by events, never by wall-clock times."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import types

import jax
import numpy as np
import pytest

from jaxserve import LLMEngine, SamplingParams
from jaxserve.runner import factory, warmup
from jaxserve.runner.abstract_weights import mismatch
from jaxserve.runner.plan import FUSED_STEP_ENV
from jaxserve.runner.startup import BackgroundCall, StartupPipeline
from jaxserve.runner.step_compiles import StepCompiles

# The fewest buckets that still batch two requests (a server compiles all of them).
ENGINE = dict(
    num_kv_blocks=33, block_size=16, max_num_seqs=2, max_num_batched_tokens=4, max_model_len=64
)
WAIT_S = 300  # a bound on every wait between the two threads: reached only when broken


def _threads(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def _record_events(monkeypatch) -> list[tuple[str, str]]:
    events = []
    real = StartupPipeline._event

    def event(self, what, when):
        events.append((what, when))
        real(self, what, when)

    monkeypatch.setattr(StartupPipeline, "_event", event)
    return events


def test_background_call_returns_raises_and_leaves_no_thread():
    assert BackgroundCall(lambda: 7, "jaxserve-test").start().result() == 7
    failing = BackgroundCall(lambda: 1 / 0, "jaxserve-test").start()
    failing.wait()
    with pytest.raises(ZeroDivisionError):
        failing.raise_if_failed()
    with pytest.raises(ZeroDivisionError):
        failing.result()
    assert _threads("jaxserve-test") == []
    blocked, release = BackgroundCall(lambda: release.wait(WAIT_S), "jaxserve-test"), None
    release = threading.Event()
    blocked.start()
    blocked.raise_if_failed()  # still running: nothing to raise, and no wait
    release.set()
    assert blocked.result() is True


def test_mismatch_names_the_first_difference():
    model = factory.get_model(_tiny_arch())
    shapes = model.param_shapes()
    concrete = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    abstract = _ckpt(shapes)
    assert mismatch(abstract, _ckpt(concrete)) is None
    key = next(iter(concrete))
    wrong = dict(concrete)
    wrong[key] = jax.tree_util.tree_map(lambda x: x.astype(np.float16), concrete[key])
    assert key in mismatch(abstract, _ckpt(wrong)) and "dtype" in mismatch(abstract, _ckpt(wrong))
    other_eos = dataclasses.replace(_ckpt(concrete), eos_token_ids=frozenset({1, 2}))
    assert "eos_token_ids" in mismatch(abstract, other_eos)


def _tiny_arch():
    from jaxserve.checkpoints_tools.load import load_arch

    return load_arch("tiny-random-llama")


def _ckpt(params):
    from jaxserve.checkpoints_tools import LoadedCheckpoint, TokenizerInfo

    arch = _tiny_arch()
    return LoadedCheckpoint(arch=arch, params=params, dtype=np.dtype(np.float32),
                            eos_token_ids=frozenset({2}), max_position_embeddings=64,
                            tokenizer=TokenizerInfo(None))  # fmt: skip


def _generate(engine: LLMEngine) -> list[list[int]]:
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    params = [SamplingParams(max_tokens=6, temperature=0.0),
              SamplingParams(max_tokens=6, temperature=0.9, seed=3)]  # fmt: skip
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done = {}
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.slow
def test_a_server_compiles_while_its_weights_load_and_generates_the_same_tokens(monkeypatch):
    events = _record_events(monkeypatch)
    compiled = threading.Event()
    real_compile, real_load = warmup.compile_set, factory._load_weights

    def compile_set(*args, **kwargs):
        real_compile(*args, **kwargs)
        compiled.set()

    def load(resolved):
        # The load waits for the whole warm-up set to compile: a start-up that compiled only
        # after the weights were in would never get here (bounded: it fails instead).
        if not compiled.wait(WAIT_S):
            raise TimeoutError("the compilations waited for the weights")
        return real_load(resolved)

    monkeypatch.setattr(warmup, "compile_set", compile_set)
    monkeypatch.setattr(factory, "_load_weights", load)
    engine = LLMEngine("tiny-random-llama", **ENGINE)
    # The attention self-check, the runner and the compilations, all before the load ended.
    assert events == [("load", "start"), ("resolve", "end"), ("compile", "start"),
                      ("compile", "end"), ("load", "end"), ("weights", "attached")]  # fmt: skip
    assert engine.info.plan.attention_checked
    assert all(isinstance(p, jax.Array) for p in jax.tree_util.tree_leaves(engine.runner.params))
    overlapped = _generate(engine)
    stats = engine.get_stats()
    assert stats["recompilations"] == [] and _threads("jaxserve-weights") == []
    del engine
    # The same engine with the weights loaded first (as an FP8 KV cache's start-up is).
    monkeypatch.setattr(factory, "_load_weights", real_load)
    monkeypatch.setattr(factory, "_weights_first", lambda resolved: True)
    events.clear()
    engine = LLMEngine("tiny-random-llama", **ENGINE)
    assert events == []
    assert _generate(engine) == overlapped
    assert engine.get_stats()["recompilations"] == []


def test_processes_of_one_mesh_overlap_only_a_load_without_collectives(monkeypatch):
    """The processes of one mesh must issue their cross-process computations in the same
    order. The built-in and Hugging Face loads issue none (checkpoint.place), so they overlap
    the runner's build as on one process; an Orbax restore synchronises the processes itself,
    so it runs alone, before the runner is built; a background warm-up (a stage runs at each
    process's own time) is refused before anything is read or allocated."""
    events = _record_events(monkeypatch)
    # factory's view only: the mesh itself still sees this one process
    monkeypatch.setattr(factory, "jax", types.SimpleNamespace(process_count=lambda: 2))
    with pytest.raises(ValueError, match="enable_background_warmup=True with 2 jax processes"):
        LLMEngine("tiny-random-llama", warmup=True, enable_background_warmup=True, **ENGINE)
    assert events == []
    engine = LLMEngine("tiny-random-llama", **ENGINE)
    assert events  # the load thread
    assert len(_generate(engine)) == 2
    events.clear()
    monkeypatch.setattr(factory, "is_orbax_checkpoint", lambda source: True)
    engine = LLMEngine("tiny-random-llama", **ENGINE)
    assert events == []  # the sequential start-up: no load thread
    assert len(_generate(engine)) == 2


@pytest.mark.slow
def test_a_failed_load_stops_the_compilations_and_is_raised(monkeypatch):
    lowered, failed = [], threading.Event()
    real_lower = StepCompiles.lower

    def lower(self, *args):
        lowered.append(self.name)
        if len(lowered) == 1:  # let the load fail now, before the next compilation's check
            started.set()
            assert failed.wait(WAIT_S)
            for _ in range(WAIT_S * 100):  # until its thread has ended (its done flag set)
                if not _threads("jaxserve-weights"):
                    break
                time.sleep(0.01)
        return real_lower(self, *args)

    started = threading.Event()

    def load(resolved):
        assert started.wait(WAIT_S)
        failed.set()  # (the thread ends right after: BackgroundCall's done follows)
        raise ValueError("model.safetensors: truncated")

    monkeypatch.setattr(StepCompiles, "lower", lower)
    monkeypatch.setattr(factory, "_load_weights", load)
    with pytest.raises(ValueError, match="truncated"):
        LLMEngine("tiny-random-llama", **ENGINE)
    # The compilation under way when the load failed finished; none started after it.
    assert len(lowered) == 1
    assert _threads("jaxserve-weights") == [] and _threads("jaxserve-compile") == []


def test_a_failed_build_waits_for_the_load_and_raises_its_own_error(monkeypatch):
    failed, load_ended = threading.Event(), []
    real_load = factory._load_weights

    def load(resolved):
        assert failed.wait(WAIT_S)  # still loading when the calling thread fails
        ckpt = real_load(resolved)
        load_ended.append(True)
        return ckpt

    def make_runner(resolved, ckpt):
        failed.set()
        raise RuntimeError("no room for the KV pages")

    monkeypatch.setattr(factory, "_load_weights", load)
    monkeypatch.setattr(factory, "make_runner", make_runner)
    with pytest.raises(RuntimeError, match="no room"):
        LLMEngine("tiny-random-llama", warmup=False, **ENGINE)
    assert load_ended == [True] and _threads("jaxserve-weights") == []


def test_weights_other_than_their_shapes_rebuild_the_runner(monkeypatch, caplog):
    real = factory._abstract_weights

    def other_eos(resolved):
        return dataclasses.replace(real(resolved), eos_token_ids=frozenset({1, 7}))

    monkeypatch.setattr(factory, "_abstract_weights", other_eos)
    events = _record_events(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        engine = LLMEngine("tiny-random-llama", warmup=False, **ENGINE)
    assert "eos_token_ids" in caplog.text and events[-1] == ("weights", "attached")
    assert engine.runner.eos_token_ids == sorted(engine.info.eos_token_ids)


def test_warmup_lists_the_smallest_steps_first_each_prefix_runnable(monkeypatch):
    monkeypatch.setenv(FUSED_STEP_ENV, "0")  # the two halves, as on an accelerator
    engine = LLMEngine("tiny-random-llama", warmup=False, **ENGINE | {"max_num_batched_tokens": 16})
    runner = engine.runner
    what = runner.warmup_set()
    jobs = warmup.compilations(runner, what)
    num_copies = len(what.copy_sizes)
    assert all(j.compiles is runner.copy_compiles for j in jobs[:num_copies])  # small: first
    tokens, rows, listed = [], set(), set()

    def runnable() -> bool:  # every listed forward's row bucket in every sampler variant
        return {(r, w) for r, w in what.samples if r in rows} <= listed

    for job in jobs[num_copies:]:
        if job.compiles is runner.forward_compiles:
            assert runnable()
            tokens.append(job.args[2].shape[0])  # input_ids: T
            rows.add(job.args[4].shape[0])  # logits_indices: R
        else:
            assert job.compiles is runner.sample_compiles
            md = job.args[3]
            widths = (md.penalty_token_ids.shape[1], md.banned_token_ids.shape[1])
            listed.add((job.args[0].shape[0], widths))
    assert runnable() and tokens == sorted(tokens) and len(tokens) == len(what.shapes) > 2
