"""The engine is never left broken: a fault at any stage of a step, Ctrl-C, prompts at the
length limit, threads, rebuilt LLMs, and inputs that used to slip past validation."""

from __future__ import annotations

import gc
import json
import pathlib
import subprocess
import sys
import threading
import weakref

import pytest
from engine_utils import SMALL, assert_nothing_held, random_prompts, step_program

from jaxserve import LLM, LLMEngine, SamplingParams
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.engine.request_state import RequestState
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.model_runner import ModelRunner

# On one xdist worker: the module's llm fixture and its reference run are built once.
pytestmark = pytest.mark.xdist_group("robustness")

MAX_LEN = SMALL["max_model_len"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SIGINT_SCRIPT = pathlib.Path(__file__).with_name("sigint_generate.py")


def _workload() -> tuple[list, list[SamplingParams]]:
    """Shared 24-token prefixes (prefix hits: a stale prefix cache would change tokens), a long
    prompt (chunked prefill), and an n=2 request (copy-on-write of its partial block)."""
    shared = random_prompts(1, seed=20, lo=24, hi=25)[0]
    prompts = [shared + p for p in random_prompts(4, seed=21, lo=3, hi=12)]
    prompts += random_prompts(2, seed=22, lo=60, hi=70)
    params = [GREEDY] * len(prompts)
    prompts.append(shared + [7, 8, 9])
    params.append(SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True))
    return prompts, params


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random-llama", num_kv_blocks=48, **SMALL)


@pytest.fixture(scope="module")
def reference(llm) -> list[list[list[int]]]:
    prompts, params = _workload()
    return _tokens(llm.generate(prompts, params, use_tqdm=False))


def assert_runner_empty(llm: LLM) -> None:
    assert llm.engine.runner.is_idle


def _inject(monkeypatch, owner, name: str, at_call: int, exc: BaseException, after: bool):
    """Make ``owner.name`` raise ``exc`` on its ``at_call``-th call, before or after the real
    call ran (after: its effects happened, its result is lost)."""
    name = step_program(owner, name) if name in ("_forward", "_sample") else name
    real = getattr(owner, name)
    calls = 0

    def faulty(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == at_call and not after:
            raise exc
        result = real(*args, **kwargs)
        if calls == at_call:
            raise exc
        return result

    monkeypatch.setattr(owner, name, faulty)
    return lambda: calls


# (stage, where the fault is injected, after the real call?). Class attributes are patched
# where the engine rebuilds the instance on recovery (the runner's host buffers). With the
# CPU's fused step both halves' faults land in the fused program (engine_utils.step_program).
STAGES = {
    "after schedule": (lambda llm: Scheduler, "schedule", True),
    "preparing inputs": (lambda llm: InputBatch, "prepare", False),
    "before the forward half": (lambda llm: llm.engine.runner, "_forward", False),
    "after the forward half": (lambda llm: llm.engine.runner, "_forward", True),
    "before the sample half": (lambda llm: llm.engine.runner, "_sample", False),
    "after the sample half": (lambda llm: llm.engine.runner, "_sample", True),
    "copy-on-write": (lambda llm: llm.engine.runner, "_copy", True),
    "collecting samples": (lambda llm: ModelRunner, "collect", False),
    "scheduler update": (lambda llm: Scheduler, "update_from_output", False),
    "inside the scheduler update": (lambda llm: KVCacheManager, "cache_blocks", True),
    "output processing": (lambda llm: RequestState, "apply", False),
}


@pytest.mark.parametrize("exc", [RuntimeError("injected"), KeyboardInterrupt()], ids=repr)
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_fault_at_any_stage_aborts_and_the_engine_serves_on(
    llm, reference, monkeypatch, stage, exc
):
    owner, name, after = STAGES[stage]
    at_call = 1 if stage == "copy-on-write" else 3
    calls = _inject(monkeypatch, owner(llm), name, at_call, exc, after)
    prompts, params = _workload()
    with pytest.raises(type(exc)):
        llm.generate(prompts, params, use_tqdm=False)
    assert calls() >= at_call
    monkeypatch.undo()
    assert_nothing_held(llm.engine)
    assert_runner_empty(llm)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == reference
    assert_nothing_held(llm.engine)


def test_lost_kv_pages_are_reallocated_and_the_prefix_cache_dropped(llm, reference, monkeypatch):
    _inject(monkeypatch, llm.engine.runner, "_forward", 2, RuntimeError("injected"), after=True)
    prompts, params = _workload()
    with pytest.raises(RuntimeError):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.scheduler.kv_cache_manager.block_pool.cached_blocks
    assert not any(k.is_deleted() for k, _ in llm.engine.runner.kv_caches)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == reference


def test_a_failed_engine_step_aborts_every_request(llm, monkeypatch):
    engine = llm.engine
    for i, p in enumerate(random_prompts(3, seed=30)):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    _inject(monkeypatch, Scheduler, "update_from_output", 1, ValueError("bad"), after=False)
    with pytest.raises(ValueError, match="bad"):
        engine.step()
    monkeypatch.undo()
    assert_nothing_held(engine)
    engine.add_request("r0", [5, 6, 7], GREEDY)  # the ids are free again
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(engine)


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_prompts_at_the_length_limit(llm, delta):
    prompt = random_prompts(1, seed=31, lo=MAX_LEN + delta, hi=MAX_LEN + delta + 1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    if delta > 0:
        with pytest.raises(ValueError, match=rf"prompts\[0\]: .*{MAX_LEN + 1} tokens, more than "):
            llm.generate([prompt], params, use_tqdm=False)
    else:
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        # The sequence may reach max_model_len; a prompt of exactly max_model_len still
        # samples one token (it needs no KV slot).
        (completion,) = out.outputs
        assert len(completion.token_ids) == 1
        assert completion.finish_reason == "length"
    assert_nothing_held(llm.engine)
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].finished


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_score_at_the_length_limit(llm, delta):
    prompt, cont = [5] * 100, [6] * (MAX_LEN - 100 + delta)
    if delta > 0:
        with pytest.raises(ValueError, match=r"pairs\[0\].*more than max_model_len"):
            llm.score([prompt], [cont])
    else:
        (score,) = llm.score([prompt], [cont])
        assert score < 0
    assert_nothing_held(llm.engine)


def test_penalties_at_the_length_limit(llm):
    # Every token distinct, with a penalty: the penalty lists hold max_model_len + 1 tokens.
    prompt = list(range(3, 3 + MAX_LEN))
    params = SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.3)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1
    assert_nothing_held(llm.engine)


@pytest.mark.slow
def test_sigint_during_generate_never_breaks_the_llm(tmp_path):
    """Real SIGINTs at random moments of generate (some doubled, to stop inside a step), in a
    subprocess; after each, the LLM holds nothing and serves the same greedy tokens."""
    proc = subprocess.run(
        [sys.executable, str(SIGINT_SCRIPT), "--rounds", "24", "--budget-s", "90"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["mismatches"] == 0 and summary["held_after"] == 0, summary
    assert summary["interrupted"] >= 6, summary  # most rounds are hit mid-generate


def test_two_threads_calling_generate_are_serialised(llm):
    prompt_sets = [random_prompts(4, seed=40 + k) for k in range(2)]
    alone = [_tokens(llm.generate(p, GREEDY, use_tqdm=False)) for p in prompt_sets]
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for _ in range(3):
                results[k] = _tokens(llm.generate(prompt_sets[k], GREEDY, use_tqdm=False))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert [results[0], results[1]] == alone
    assert_nothing_held(llm.engine)


@pytest.mark.slow
def test_dropped_llms_free_their_memory_without_the_cyclic_gc():
    freeze_count = gc.get_freeze_count()
    refs = []
    gc.disable()  # freed by reference counting alone: nothing of the engine is in a cycle
    try:
        for _ in range(3):
            llm = LLM(
                "tiny-random-llama", num_kv_blocks=16, block_size=8, max_model_len=64, warmup=False
            )
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
            runner = llm.engine.runner
            refs += [
                weakref.ref(llm.engine),
                weakref.ref(runner),
                weakref.ref(runner.kv_caches[0][0]),
            ]
            del llm, runner
            assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()
    assert gc.get_freeze_count() == freeze_count


def test_sampling_params_changed_after_construction_are_checked_and_honoured(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    params.temperature = float("nan")
    with pytest.raises(ValueError, match="temperature must be >= 0, got nan"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    params.temperature = 0.0
    params.skip_special_tokens = "no"
    with pytest.raises(TypeError, match="skip_special_tokens must be a bool"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    params.skip_special_tokens = True
    (full,) = llm.generate(["The capital"], params, use_tqdm=False)
    text = full.outputs[0].text
    assert len(text) >= 4
    params.stop = [text[2:4]]
    (stopped,) = llm.generate(["The capital"], params, use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop"
    assert len(stopped.outputs[0].text) < len(text)
    # A queued request keeps the params it was queued with.
    params.stop, params.max_tokens = None, 5
    llm.engine.add_request("q", [5, 6, 7], params)
    params.max_tokens = 1
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    assert len(outs[-1].outputs[0].token_ids) == 5
    assert_nothing_held(llm.engine)


def test_priority_is_checked(llm):
    with pytest.raises(TypeError, match="priority must be an int, got 'high'"):
        llm.engine.add_request("p", [5, 6, 7], GREEDY, priority="high")
    assert_nothing_held(llm.engine)


def test_user_ids_never_collide_with_sample_ids(llm):
    engine = llm.engine
    two = SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True)
    solo = llm.generate([[9, 10, 11]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("y", [5, 6, 7], two)
    engine.add_request("1_y", [9, 10, 11], GREEDY)  # vLLM would name y's second sample so
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = out
    assert len(final["y"].outputs) == 2
    assert final["1_y"].outputs[0].token_ids == solo
    assert_nothing_held(engine)


@pytest.mark.parametrize(
    "prompt, error, match",
    [
        ({"prompt_token_ids": (t for t in [5, 6])}, TypeError, "list of int, got generator"),
        ({"prompt_token_ids": [5, "6"]}, TypeError, "element '6'"),
        ("abc\ud800def", ValueError, r"not valid Unicode.*'\\ud800' at character 3"),
    ],
)
def test_prompts_that_used_to_slip_through(llm, prompt, error, match):
    with pytest.raises(error, match=rf"prompts\[1\]: .*{match}"):
        llm.generate([[5, 6, 7], prompt], GREEDY, use_tqdm=False)
    assert_nothing_held(llm.engine)


@pytest.mark.parametrize("inside_step", [True, False])
def test_an_interrupted_generate_leaves_no_request_behind(llm, monkeypatch, inside_step):
    """The reported case: an interrupted generate must not leave its requests to be run,
    silently, by the next call; whether Ctrl-C lands inside a step or between two."""
    if inside_step:
        _inject(monkeypatch, ModelRunner, "dispatch", 4, KeyboardInterrupt(), after=False)
    else:
        _inject(monkeypatch, LLMEngine, "step", 4, KeyboardInterrupt(), after=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts(20, seed=50), GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    steps = llm.get_stats()["num_steps"]
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert llm.get_stats()["num_steps"] - steps == 2
