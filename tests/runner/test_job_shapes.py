"""Job-sized warm-up sets (runner/job_shapes.py): bounds from the requests alone, a subset of
the full set, and the sampler-variant predicate kept in step with SamplingInputs."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.runner.buckets import BucketSpec
from jaxserve.runner.job_shapes import (
    JobRequest,
    job_request,
    job_warmup_set,
    needs_sampling_lists,
)
from jaxserve.runner.sampling_metadata import SamplingInputs
from jaxserve.sampling_params import SamplingParams

SPEC = BucketSpec.create(
    max_num_batched_tokens=256, max_num_seqs=16, max_blocks_per_seq=32,
    mid_token_buckets=True, single_token_bucket=True,
)  # fmt: skip
VARIANTS = ((0, 0), (129, 9))
COPIES = (1, 2, 4, 8, 16)


def _set(requests, **kw):
    args = dict(block_size=8, max_num_batched_tokens=256, max_model_len=256,
                variant_widths=VARIANTS, copy_sizes=COPIES)  # fmt: skip
    return job_warmup_set(requests, SPEC, **{**args, **kw})


def test_small_job_gets_small_buckets_only():
    ws = _set([JobRequest(10, 16, 1, False)] * 3)  # 3 x 26 tokens at most, 4 pages each
    assert {t for t, _, _ in ws.shapes} == {t for t in SPEC.token_buckets if t <= 96}
    assert {b for _, _, b in ws.shapes} == {1, 2, 4}
    assert ws.variants == ((0, 0),) and ws.copy_sizes == ()
    assert set(ws.shapes) < set(SPEC.all_shapes())
    assert list(ws.shapes) == sorted(ws.shapes)  # the smallest first


def test_bounds_cover_budget_forks_lists_and_drafts():
    big = _set([JobRequest(200, 100, 1, False)] * 4)
    assert big.shapes == tuple(SPEC.all_shapes())  # the budget and max_model_len cap it
    forked = _set([JobRequest(5, 4, 3, True), JobRequest(5, 4, 2, False)])
    assert forked.variants == VARIANTS
    assert forked.copy_sizes == (1, 2, 4, 8)  # up to 5 forked sequences a step, padded
    assert max(t for t, _, _ in forked.shapes) == 48  # 5 x 9 = 45 tokens
    drafts = _set([JobRequest(6, 2, 1, False)], num_spec_tokens=4)
    assert max(b for _, _, b in drafts.shapes) == 2  # 6 + 2 + 4 = 12 tokens: 2 pages
    with pytest.raises(ValueError, match="no request"):
        _set([])


def test_a_pool_that_holds_every_sequence_bounds_t_by_the_prompts():
    jobs = [JobRequest(20, 30, 2, False), JobRequest(3, 60, 1, False)]  # 7 + 7 + 8 blocks
    loose = _set(jobs)  # 2 x 50 + 63 = 163 tokens: T up to 192
    assert max(t for t, _, _ in loose.shapes) == 192
    roomy = _set(jobs, num_usable_blocks=22)  # no preemption: 2 x 20 + 3 = 43 tokens
    assert max(t for t, _, _ in roomy.shapes) == 48
    assert _set(jobs, num_usable_blocks=21).shapes == loose.shapes  # preemption possible
    drafts = _set(jobs, num_usable_blocks=100, num_spec_tokens=4)  # 2 x 20 + max(3, 5)
    assert max(t for t, _, _ in drafts.shapes) == 48
    assert {b for _, _, b in roomy.shapes} == {b for _, _, b in loose.shapes}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, seed=3, logprobs=2),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(frequency_penalty=-0.5),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(min_tokens=2),
        SamplingParams(min_tokens=2, stop_token_ids=[7], ignore_eos=True),
        SamplingParams(allowed_token_ids=[3, 4, 5]),
        SamplingParams(logit_bias={3: 1.0}),
        SamplingParams(stop=["."], n=2, prompt_logprobs=1),
    ],
)
def test_the_list_variant_is_predicted(params):
    """Whenever SamplingInputs builds a row with lists, needs_sampling_lists said so."""
    inputs = SamplingInputs(4, 32, 64, eos_token_ids=[2])
    inputs.set_request(0, params, 1, [5, 6, 7])
    md = inputs.build(np.array([0], np.int32), 2, np.array([0], np.int32))
    widths = (md.penalty_token_ids.shape[1], md.banned_token_ids.shape[1])
    if widths != (0, 0):
        assert needs_sampling_lists(params, has_step_mask=False)
    assert job_request(3, params, True).needs_lists  # a grammar or bad words: always
