"""The n-gram (prompt lookup) proposer against a brute-force reference, and its incremental
token buffers."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode.ngram_proposer import NgramProposer, propose_ngram


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first; for it, the most recent earlier occurrence (ending before the last
    token) proposes what followed."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        for end in range(size - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=0, max_size=40),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 5),
)
def test_matches_brute_force(tokens, min_n, extra, k):
    got = propose_ngram(np.array(tokens, np.int32), min_n, min_n + extra, k)
    assert got == _brute_force(tokens, min_n, min_n + extra, k)


def test_examples():
    arr = lambda xs: np.array(xs, np.int32)  # noqa: E731
    # "a b c d ... a b c" -> "d ..." (longest match wins over the more recent "c")
    assert propose_ngram(arr([1, 2, 3, 4, 5, 9, 3, 1, 2, 3]), 1, 3, 2) == [4, 5]
    # the most recent occurrence may overlap the suffix; proposals stop at the known tokens
    assert propose_ngram(arr([7, 7, 7, 7]), 1, 2, 3) == [7]
    assert propose_ngram(arr([7, 8, 7, 8, 7]), 1, 2, 3) == [8, 7]
    assert propose_ngram(arr([1, 2, 3]), 1, 4, 3) == []  # no earlier occurrence
    assert propose_ngram(arr([1, 2, 1]), 2, 4, 3) == []  # only a 1-gram matches


def test_buffers_follow_appended_tokens_and_forget_finished_requests():
    proposer = NgramProposer(3, 1, 3)
    req = Request("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=10))
    other = Request("b", [4, 4], SamplingParams(max_tokens=10))
    assert proposer.propose([req, other], 3) == {"a": [3, 1, 2], "b": [4]}
    req.append_output_token_id(3)
    req.append_output_token_id(9)
    req.append_output_token_id(1)
    for _ in range(100):  # grows the buffer past its first size
        req.append_output_token_id(5)
    req.append_output_token_id(2)
    assert proposer.propose([req], 2) == {"a": [3, 9]}  # "1 2" last seen before "3 9"
    assert set(proposer._buffers) == {"a"}
