"""The policy's arms: "fit" drafts fill the padding rows of the step's own token bucket, from
the runner's buckets and the batch (prefill tokens in the step count), capped by k; arms of
equal length are one."""

from __future__ import annotations

import pytest

from jaxserve.spec_decode.draft_arms import draft_arms, fit_drafts, padded_tokens

CPU = (1, 4, 6, 8, 12, 16)  # the CPU's: a single-token bucket and midpoints (runner/buckets.py)
GPU = (4, 8, 16, 32)


def test_padded_tokens():
    assert [padded_tokens(n, CPU) for n in (1, 2, 4, 5, 7, 16)] == [1, 4, 4, 6, 8, 16]
    assert padded_tokens(3, GPU) == 4 and padded_tokens(33, GPU) == 33  # past the largest


@pytest.mark.parametrize(
    "buckets, decodes, other, k, fit",
    [
        (GPU, 1, 0, 4, 3),  # 1 + 3 = 4: the step stays at T = 4
        (GPU, 1, 0, 2, 2),  # capped by k
        (GPU, 2, 0, 4, 1),  # 2 + 2 * 1 = 4
        (GPU, 3, 0, 4, 0),  # one padding row for three decodes: none each
        (GPU, 1, 2, 4, 1),  # a 2-token prefill chunk in the step: 1 + 2 + 1 = 4
        (GPU, 1, 4, 4, 3),  # 5 tokens pad to 8: room for 3
        (CPU, 1, 0, 4, 0),  # T = 1 is a bucket: no padding to fill
        (CPU, 2, 0, 4, 1),
        (CPU, 5, 0, 4, 0),  # 5 -> 6
        (GPU, 0, 3, 4, 0),
    ],
)
def test_fit_drafts(buckets, decodes, other, k, fit):
    assert fit_drafts(decodes, k, buckets, other) == fit
    if decodes:  # the step with the drafts pads to what it would without them
        tokens = decodes + other
        assert padded_tokens(tokens + decodes * fit, buckets) == padded_tokens(tokens, buckets)


def test_arms_in_measuring_order_duplicates_collapsed():
    assert draft_arms(1, 4, GPU) == {"k": 4, "fit": 3, "off": 0}
    assert list(draft_arms(1, 4, GPU)) == ["k", "fit", "off"]
    assert draft_arms(1, 3, GPU) == {"k": 3, "off": 0}  # fit == k
    assert draft_arms(4, 4, GPU) == {"k": 4, "off": 0}  # fit == 0
    assert draft_arms(1, 4, CPU) == {"k": 4, "off": 0}
    assert draft_arms(2, 4, CPU) == {"k": 4, "fit": 1, "off": 0}
    assert draft_arms(1, 4, None) == {"k": 4, "off": 0}
