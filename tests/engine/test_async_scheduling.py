"""Async scheduling (docs/engine_step.md) changes when the host works, never what comes out:
greedy and seeded tokens, logprobs, finish reasons and stop strings are identical with and
without it, under the scheduler's stress settings (preemption, chunked prefill, prefix hits),
with EOS, stop strings, max_tokens of 1, n > 1, penalties, min_tokens and aborts in the mix;
nothing is held afterwards. One engine serves both modes (EngineCore.reset_scheduler switches
them): both run the same executables (tests/runner/test_warmup.py checks that nothing compiles
after warm-up, in the platform's mode)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import assert_nothing_held, random_prompts

from jaxserve import LLM, SamplingParams

# One xdist worker builds the module's engine once.
pytestmark = pytest.mark.xdist_group("async_scheduling")

STRESS = dict(
    block_size=4,
    num_kv_blocks=28,  # the mixed workload below needs more: preemption happens
    max_num_seqs=6,
    max_num_batched_tokens=16,  # smaller than the long prompts: chunked prefill
    max_model_len=56,
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random-llama", warmup=False, seed=7, **STRESS)


def _mixed_workload() -> tuple[list, list[SamplingParams]]:
    shared = random_prompts(1, seed=3, lo=17, hi=18)[0]
    prompts = [shared + p for p in random_prompts(4, seed=4, lo=2, hi=9)]  # prefix hits
    prompts += random_prompts(3, seed=5, lo=24, hi=36)  # chunked prefill
    prompts += ["The quick brown fox", "Once upon a time"]  # text: stop strings
    greedy = dict(temperature=0.0, ignore_eos=True)
    params = [
        SamplingParams(max_tokens=12, **greedy),
        SamplingParams(max_tokens=1, **greedy),
        SamplingParams(max_tokens=9, temperature=0.9, seed=11, logprobs=3),
        SamplingParams(max_tokens=10, n=2, temperature=1.0, seed=5),
        SamplingParams(
            max_tokens=14,
            temperature=0.8,
            seed=3,
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            presence_penalty=0.2,
        ),  # fmt: skip
        SamplingParams(max_tokens=11, temperature=0.0, min_tokens=4, prompt_logprobs=2),
        SamplingParams(max_tokens=16, temperature=0.0),  # EOS allowed
        SamplingParams(max_tokens=20, temperature=0.7, seed=1, stop=["e", "o"]),
        SamplingParams(max_tokens=20, temperature=0.0, stop=[" "], include_stop_str_in_output=True),
    ]
    return prompts, params


def _run(llm: LLM, on: bool, prompts, params) -> tuple[list, list]:
    """(tokens, texts and finish reasons; logprobs as (token, value) lists), of every sample."""
    llm.engine.core.reset_scheduler(async_scheduling=on)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_nothing_held(llm.engine)
    exact = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
             for o in outs]  # fmt: skip
    logprobs = [[_lp(c.logprobs) for c in o.outputs] + [_lp(o.prompt_logprobs)] for o in outs]
    return exact, logprobs


def _lp(logprobs) -> list:
    """Logprobs as (token id, value) pairs, position by position."""
    return [
        [] if step is None else sorted((t, v.logprob) for t, v in step.items())
        for step in logprobs or []
    ]


def _assert_close(a: list, b: list) -> None:
    """The same tokens with the same logprobs, up to float32 rounding (a step's batch, and so
    the summation order, differs between the two modes)."""
    flat = lambda x: list(_leaves(x))  # noqa: E731
    ids_a, vals_a = zip(*flat(a), strict=True) if flat(a) else ((), ())
    ids_b, vals_b = zip(*flat(b), strict=True) if flat(b) else ((), ())
    assert ids_a == ids_b
    assert np.allclose(vals_a, vals_b, atol=1e-4)


def _leaves(x):
    if isinstance(x, tuple):
        yield x
    else:
        for y in x:
            yield from _leaves(y)


def test_outputs_are_identical_with_and_without(llm):
    prompts, params = _mixed_workload()
    sync, sync_lp = _run(llm, False, prompts, params)
    stats_sync = llm.get_stats()
    on, on_lp = _run(llm, True, prompts, params)
    assert on == sync
    _assert_close(on_lp, sync_lp)
    assert stats_sync["num_preemptions"] > 0 and stats_sync["prefix_cache_hits"] > 0
    assert llm.get_stats()["num_preemptions"] > 0


def test_aborts_mid_run_leave_nothing_behind(llm):
    """Requests aborted while a step runs ahead of them: the others' tokens do not change."""
    engine = llm.engine
    prompts = random_prompts(6, seed=9, lo=5, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)
    expected = {}
    for on in (False, True):
        engine.core.reset_scheduler(async_scheduling=on)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        outputs = {}
        for step in range(200):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step(finished_only=True):
                outputs[out.request_id] = out.outputs[0]
            if step == 3:
                for out in engine.abort_request(["r1", "r4"]):
                    outputs[out.request_id] = out.outputs[0]
        assert_nothing_held(engine)
        assert outputs["r1"].finish_reason == outputs["r4"].finish_reason == "abort"
        kept = {rid: o.token_ids for rid, o in outputs.items() if rid not in ("r1", "r4")}
        expected.setdefault("kept", kept)
        assert kept == expected["kept"]


def test_a_request_stopped_by_a_string_wastes_its_run_ahead_row_only(llm):
    """A stop string found after the next step was dispatched: nothing past the stop is
    emitted, and the next request in the slot is unaffected."""
    params = [SamplingParams(temperature=0.0, max_tokens=30, stop=[s]) for s in ("a", "t", "\n")]
    prompts = ["Once upon a time"] * 3
    for on in (True, False):
        llm.engine.core.reset_scheduler(async_scheduling=on)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, p in zip(outs, params, strict=True):
            c = out.outputs[0]
            if c.finish_reason == "stop":
                assert c.stop_reason == p.stop[0] and p.stop[0] not in c.text
        assert_nothing_held(llm.engine)


def test_the_step_tracer_sees_the_overlap(llm):
    """With async scheduling a decode step is dispatched before the previous one ends (its
    device idle time is 0 for most steps); without, never (the host works in between)."""
    prompts = random_prompts(4, seed=2, lo=4, hi=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    queued = {}
    for on in (True, False):
        traces = []
        llm.engine.core.reset_scheduler(async_scheduling=on)
        llm.engine.set_step_tracer(traces.append)
        try:
            llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.engine.set_step_tracer(None)
        decodes = [t for t in traces if t.num_rows and t.num_tokens == t.num_rows]
        assert decodes and all(t.ready_at >= t.dispatched_at for t in decodes)
        queued[on] = sum(t.device_idle_s == 0.0 for t in decodes) / len(decodes)
    assert queued[False] == 0.0
    assert queued[True] > 0.0


def _constrained_workload() -> tuple[list, list[SamplingParams]]:
    """Structured outputs, bad words and allowed ids among unconstrained requests, with
    preemption and chunked prefill (the stress settings)."""
    digits = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
              "minItems": 2, "maxItems": 5}  # fmt: skip
    prompts = random_prompts(3, seed=6, lo=20, hi=34) + ["Pick", "Say", "Go", "Hi"]
    sampled = dict(temperature=1.0, seed=4)
    params = [
        SamplingParams(max_tokens=24, structured_outputs={"json": digits}, **sampled),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=16, n=2, structured_outputs={"regex": "[a-c]{3}-[0-9]{2}"}, **sampled
        ),  # fmt: skip
        SamplingParams(max_tokens=10, structured_outputs={"choice": ["yes", "no"]}, seed=2),
        SamplingParams(max_tokens=14, bad_words=["the"], presence_penalty=0.5, **sampled),
        SamplingParams(max_tokens=9, allowed_token_ids=list(range(5, 40)), **sampled),
        SamplingParams(max_tokens=20, structured_outputs={"json": digits}, temperature=0.0),
    ]
    return prompts, params


def _set_mode(llm: LLM, mode: str) -> None:
    llm.engine.core.reset_scheduler(async_scheduling=mode != "sync")
    llm.engine.core.overlap_masks = mode == "overlapped"


def test_token_masks_built_while_the_forward_runs_change_no_token(llm, monkeypatch):
    """A step with constrained requests runs its forward half before the step before is
    learned and its sample half after (the masks built meanwhile): the same tokens as the
    masks built after each step is learned, and as the synchronous engine."""
    prompts, params = _constrained_workload()
    runner = llm.engine.runner
    real, split = runner.dispatch_forward, []

    def forward(so, trace=None, masks_later=()):
        split.extend(masks_later)  # the requests whose masks come after the forward
        return real(so, trace, masks_later)

    monkeypatch.setattr(runner, "dispatch_forward", forward)
    results = {}
    for mode in ("sync", "post-learn", "overlapped"):
        split.clear()
        _set_mode(llm, mode)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_nothing_held(llm.engine)
        results[mode] = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
        assert bool(split) == (mode == "overlapped")  # the halves apart: only when overlapped
    assert results["overlapped"] == results["post-learn"] == results["sync"]
    assert results["sync"][3][0][0] and results["sync"][6][0][1] in ("stop", "length")
    assert llm.get_stats()["recompilations"] == []


@pytest.mark.parametrize("exc", [RuntimeError("injected"), KeyboardInterrupt()], ids=repr)
@pytest.mark.parametrize("where", ["dispatch_sample", "dispatch_forward"])
def test_a_fault_between_the_two_halves_aborts_and_the_engine_serves_on(llm, monkeypatch,
                                                                        where, exc):  # fmt: skip
    """A fault while a constrained step's forward half runs and its sample half is not yet
    dispatched: every request is aborted, nothing is held, the next run is unchanged."""
    prompts, params = _constrained_workload()
    _set_mode(llm, "overlapped")
    outs = llm.generate(prompts, params, use_tqdm=False)
    reference = [[c.token_ids for c in o.outputs] for o in outs]
    runner, calls = llm.engine.runner, []
    real = getattr(runner, where)

    def faulty(*args):
        calls.append(1)
        if len(calls) == 3:
            raise exc
        return real(*args)

    monkeypatch.setattr(runner, where, faulty)
    with pytest.raises(type(exc)):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert_nothing_held(llm.engine)
    assert llm.engine.runner.is_idle
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == reference


class _Flipping:
    """A run-ahead policy (engine/run_ahead.py's interface) that switches at random, so that
    the engine goes from running ahead to synchronous steps (a step in flight only learned)
    and back over and over."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.decisions: list[bool] = []

    def run_ahead(self, num_running: int) -> bool:
        self.decisions.append(bool(self.rng.random() < 0.5))
        return self.decisions[-1]

    def observe(self, num_tokens: int, decode_only: bool, now=None) -> None:
        pass

    def stats(self) -> dict:
        return {}


def test_a_policy_switching_run_ahead_on_and_off_changes_no_token(llm):
    prompts, params = _mixed_workload()
    sync, sync_lp = _run(llm, False, prompts, params)
    llm.engine.core.reset_scheduler(async_scheduling=True)
    llm.engine.core.run_ahead_policy = policy = _Flipping(seed=0)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.core.run_ahead_policy = None
    assert_nothing_held(llm.engine)
    flips = sum(a != b for a, b in zip(policy.decisions, policy.decisions[1:], strict=False))
    assert flips > 10
    exact = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
             for o in outs]  # fmt: skip
    assert exact == sync
    logprobs = [[_lp(c.logprobs) for c in o.outputs] + [_lp(o.prompt_logprobs)] for o in outs]
    _assert_close(logprobs, sync_lp)
