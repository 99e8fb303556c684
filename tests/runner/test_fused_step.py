"""The step fused into one jitted program (runner/fused_step.py, JAXSERVE_FUSED_STEP=1) against
its two halves (every platform's default, forced here with JAXSERVE_FUSED_STEP=0): the same
tokens and logprobs, warm-up compiling one program per (shape, sampler variant), nothing after
it."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner.job_shapes import WarmupSet
from jaxserve.runner.plan import FUSED_STEP_ENV, fused_step

ENGINE = dict(
    num_kv_blocks=40, block_size=8, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=48
)


def test_the_plan_fuses_the_step_only_when_told(monkeypatch):
    monkeypatch.delenv(FUSED_STEP_ENV, raising=False)
    assert [fused_step(p) for p in ("cpu", "gpu", "tpu")] == [False, False, False]
    monkeypatch.setenv(FUSED_STEP_ENV, "1")
    assert fused_step("cpu")
    monkeypatch.setenv(FUSED_STEP_ENV, "0")
    assert not fused_step("cpu")
    monkeypatch.setenv(FUSED_STEP_ENV, "1")
    assert fused_step("tpu")
    monkeypatch.setenv(FUSED_STEP_ENV, "yes")
    with pytest.raises(ValueError, match="JAXSERVE_FUSED_STEP must be 0 or 1.*'yes'"):
        fused_step("cpu")


def test_warmup_set_counts_fused_and_split_compilations():
    shapes = ((4, 4, 2), (8, 4, 2), (8, 8, 2), (128, 128, 2))
    what = WarmupSet(shapes, ((0, 0), (9, 5)), (1, 2))
    together, apart = what.parts()  # T == R <= FUSED_MAX_TOKENS run fused
    assert together.shapes == ((4, 4, 2), (8, 8, 2)) and together.copy_sizes == ()
    assert apart.shapes == ((8, 4, 2), (128, 128, 2)) and apart.copy_sizes == (1, 2)
    assert together.steps[:2] == (((4, 4, 2), (0, 0)), ((4, 4, 2), (9, 5)))
    # fused: 2 shapes x 2 variants; split: 2 forwards, rows 4 and 128 x 2 variants; 2 copies
    assert what.num_step_compilations(fused=True) == 4 + 2 + 4 + 2
    assert what.num_step_compilations(fused=False) == 4 + 3 * 2 + 2


def _workload():
    prompts = [[5, 6, 7, 8, 9], list(range(3, 24)), [20, 21], list(range(40, 52))]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=9, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.7, seed=4, presence_penalty=0.5, max_tokens=8, n=2),
        SamplingParams(temperature=1.0, seed=5, max_tokens=1),
    ]
    return [{"prompt_token_ids": p} for p in prompts], params


def _run(monkeypatch, fused: bool):
    monkeypatch.setenv(FUSED_STEP_ENV, "1" if fused else "0")
    llm = LLM("tiny-random-llama", **ENGINE)
    monkeypatch.delenv(FUSED_STEP_ENV)
    runner = llm.engine.runner
    assert llm.get_stats()["plan"]["fused_step"] is fused
    assert (runner.fused_compiles is not None) is fused
    warmed, real_warmup = [], runner.warmup

    def warmup(*args, what=None, **kwargs):
        warmed.append((what, real_warmup(*args, what=what, **kwargs)))
        return warmed[-1][1]

    monkeypatch.setattr(runner, "warmup", warmup)
    prompts, params = _workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert llm.get_stats()["recompilations"] == []
    # The job's warm-up compiled one fused program per (shape, sampler variant), or the halves.
    ((what, compiled),) = warmed
    assert compiled == what.num_step_compilations(fused) > 0
    steps = (runner.fused_compiles,) if fused else (runner.forward_compiles, runner.sample_compiles)
    assert all(c.warmed_up for c in steps)
    seen = [[(c.token_ids, c.cumulative_logprob, c.finish_reason) for c in o.outputs] for o in outs]
    prompt_lps = [o.prompt_logprobs for o in outs]
    if fused:  # the decode-shaped buckets ran fused
        assert runner.fused_compiles.num_fresh + runner.fused_compiles.num_cache_hits > 0
    del llm
    return seen, prompt_lps


@pytest.mark.slow
def test_fused_and_split_steps_give_the_same_tokens_and_logprobs(monkeypatch):
    fused, fused_plp = _run(monkeypatch, fused=True)
    split, split_plp = _run(monkeypatch, fused=False)
    assert fused == split
    assert fused_plp == split_plp
