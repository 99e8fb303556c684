"""Job-sized warm-up (LLM's default, engine/job_warmup.py): a job compiles only the shapes its
requests can reach, and every step it then runs (chunked prefill, preemption, prefix hits,
n > 1 forks, penalties) has a shape of that set: nothing compiles after warm-up."""

from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams

ENGINE = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
# The whole module on one xdist worker, in the group tests/conftest.py gives the users of the
# module-scoped ``llm``: the speculative engine, of the same fields, then loads the steps it
# shares with ``llm`` from the session's compilation cache instead of compiling them on the
# other worker at the same time.
pytestmark = pytest.mark.xdist_group("module:tests/engine/test_job_warmup.py")


@pytest.fixture(scope="module")
def llm():
    # 14 blocks of 8 tokens for up to 4 sequences of up to 64 tokens: preemptions.
    return LLM("tiny-random-llama", num_kv_blocks=14, **ENGINE)


def _watch(llm: LLM) -> tuple[list, list]:
    """Record each warm-up's set and each step's (shape, sampler widths, copies)."""
    runner = llm.engine.runner
    sets, steps = [], []
    warmup, forward, sample, copy = runner.warmup, runner._forward, runner._sample, runner._copy

    def watched_warmup(*args, what=None, **kw):
        sets.append(what)
        return warmup(*args, what=what, **kw)

    def watched_forward(*args):
        steps.append(("forward", (len(args[2]), *args[3].block_tables.shape)))
        return forward(*args)

    def watched_sample(*args):
        smd = args[3]
        widths = (smd.penalty_token_ids.shape[1], smd.banned_token_ids.shape[1])
        steps.append(("sample", len(args[2]), widths))
        return sample(*args)

    def watched_copy(*args):
        steps.append(("copy", len(args[1])))
        return copy(*args)

    def watched_fused(*args):  # the CPU's fused step (fused_step.FUSED_ARGS): both halves
        smd = args[10]
        widths = (smd.penalty_token_ids.shape[1], smd.banned_token_ids.shape[1])
        steps.append(("forward", (len(args[2]), *args[3].block_tables.shape)))
        steps.append(("sample", len(args[4]), widths))
        return fused(*args)

    runner.warmup, runner._forward, runner._sample = watched_warmup, watched_forward, watched_sample
    runner._copy = watched_copy
    fused = getattr(runner, "_fused", None)
    if fused is not None:
        runner._fused = watched_fused
    return sets, steps


def _job(rng: random.Random) -> tuple[list, list[SamplingParams]]:
    prefix = [rng.randrange(3, 1000) for _ in range(rng.choice([0, 8, 16]))]
    prompts, params = [], []
    for _ in range(rng.randrange(1, 7)):
        tail = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 30))]
        prompts.append({"prompt_token_ids": prefix + tail})
        params.append(
            SamplingParams(
                max_tokens=rng.randrange(1, 20),
                temperature=rng.choice([0.0, 0.8]),
                n=rng.choice([1, 1, 2, 3]),
                presence_penalty=rng.choice([0.0, 0.0, 0.5]),
                ignore_eos=True,
            )
        )
    return prompts, params


@pytest.mark.slow
def test_a_small_job_compiles_a_fraction_of_the_full_set(llm):
    runner = llm.engine.runner
    assert _compiled(llm) == 0  # nothing at construction
    prompts = [[5, 6, 7], [8, 9]]
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    # Two prompts of 3 + 2 tokens whose KV fits the pool (no preemption): T up to 6, one
    # sampler variant, no block copy (the fused step: one program per shape).
    fused = runner.plan.fused_step
    shapes = [(t, t, 8) for t in (1, 4, 6)]
    if fused:
        assert runner.warmed == {("fused", s, (0, 0)) for s in shapes}
    else:
        split = {("sample", s[1], (0, 0)) for s in shapes}
        assert runner.warmed == {("forward", s) for s in shapes} | split
    assert _compiled(llm) == (3 if fused else 6)
    assert llm.get_stats()["recompilations"] == []
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert _compiled(llm) == (3 if fused else 6)  # the same job again: nothing new


def _compiled(llm: LLM) -> int:
    stats = llm.get_stats()
    return stats["num_compilations"] + stats["num_compilation_cache_hits"]


def _run_jobs(llm: LLM, num_jobs: int, seed: int) -> None:
    """Random jobs, each checked: every step it ran is in the set its warm-up compiled."""
    sets, steps = _watch(llm)
    rng = random.Random(seed)
    for i in range(num_jobs):
        prompts, params = _job(rng)
        steps.clear()
        llm.generate(prompts, params, use_tqdm=False)
        what = sets[-1]
        allowed = {("forward", s) for s in what.shapes}
        allowed |= {("sample", r, w) for r, w in what.samples}
        allowed |= {("copy", n) for n in what.copy_sizes}
        assert set(steps) <= allowed, (i, set(steps) - allowed)
    assert llm.get_stats()["recompilations"] == []


@pytest.mark.slow
def test_every_step_of_a_job_is_in_its_warmed_set(llm):
    _run_jobs(llm, 10, seed=0)
    stats = llm.get_stats()
    assert stats["recompilations"] == []
    assert stats["num_preemptions"] > 0 and stats["num_cow_copies"] > 0
    assert stats["prefix_cache_hits"] > 0


@pytest.mark.slow
def test_speculative_decoding_stays_in_the_set():
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "policy": "always"}
    llm = LLM("tiny-random-llama", num_kv_blocks=14, speculative_config=ngram, **ENGINE)
    _run_jobs(llm, 4, seed=1)
    assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
