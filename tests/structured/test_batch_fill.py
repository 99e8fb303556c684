"""The batch fill of a step's grammar masks (structured/batch_fill.py) against the per-row
path (RequestConstraints.fill_masks): bit-identical rows over random grammar states, drafts
(right, wrong, ending the grammar), terminated and failed matchers, n > 1 samples, bad words,
allowed_token_ids and a logits width narrower than the tokenizer's. No jax."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.checkpoints_tools.tiny_random import build_tiny_tokenizer
from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.structured.batch_fill import fill_batched
from jaxserve.structured.llguidance_backend import LLGuidanceBackend, LLGuidanceBatchFiller
from jaxserve.structured.manager import StructuredOutputs
from jaxserve.structured.request_constraints import ALL_ALLOWED
from jaxserve.structured.step_masks import token_masks

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 500},
        "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
        "s": {"type": "string", "maxLength": 6},
    },
    "required": ["n", "tags"],
    "additionalProperties": False,
}
PARAMS = [
    {"structured_outputs": {"json": SCHEMA}},
    {"structured_outputs": {"regex": r"[ab]{1,3}-[0-9]{2}"}},
    {"structured_outputs": {"choice": ["red", "green", "blue"]}},
    {"structured_outputs": {"grammar": 'start: "<" D ("," D)* ">"\nD: /[0-9]{1,2}/'}},
    {"structured_outputs": {"json_object": True}, "bad_words": ["the", "hello world"]},
    {"structured_outputs": {"json": SCHEMA}, "allowed_token_ids": list(range(3, 700))},
    {"bad_words": ["France"]},  # no grammar: row by row
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _allowed(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def _walk(state, ids: list[int], rng, steps: int) -> list[int]:
    """Up to ``steps`` tokens drawn among the allowed ones, accepted; returns them."""
    out: list[int] = []
    for _ in range(steps):
        row = np.full(state.num_words, ALL_ALLOWED, np.uint32)
        state.fill_mask(row, ids + out)
        allowed = _allowed(row)
        if not allowed.size:
            break
        token = int(rng.choice(allowed))
        out.append(token)
        if state.accept([token]) is not None:
            break
    return out


def _drafts(state, ids: list[int], rng) -> list[int]:
    """Drafts of one of five kinds: none, a right run, a right run then a wrong token, random
    tokens, a right run past the grammar's end (the matcher left as it was)."""
    kind = rng.integers(5)
    matcher = state.matcher
    if kind == 0 or (matcher is not None and (matcher.is_terminated() or matcher.error())):
        return []  # a matcher past its end or failed: its request ends, it never drafts
    if kind == 3:
        return rng.integers(0, 1024, size=int(rng.integers(1, 4))).tolist()
    right, accepted = [], 0
    for _ in range(int(rng.integers(1, 5)) + (6 if kind == 4 else 0)):
        row = np.full(state.num_words, ALL_ALLOWED, np.uint32)
        state.fill_mask(row, ids + right)
        allowed = _allowed(row)
        if not allowed.size:
            break
        right.append(int(rng.choice(allowed)))
        if matcher is not None:
            assert matcher.accept_token(right[-1])
            accepted += 1
            if matcher.is_terminated():
                break
    if matcher is not None:
        matcher.rollback(accepted)
    if kind == 2:
        right.append(int(rng.integers(0, 1024)))
    return right or [5]


def _requests(structured, rng, num: int) -> list[SimpleNamespace]:
    """``num`` requests at random grammar states: each spec's samples (n > 1) walk apart."""
    specs = [structured.check(SamplingParams(**p)) for p in PARAMS]
    reqs = []
    for i in range(num):
        state = specs[i % len(specs)].new_state()
        ids = _walk(state, [], rng, int(rng.integers(0, 12)))
        if rng.random() < 0.05 and state.matcher is not None:
            state.accept([int(rng.integers(0, 1024))])  # maybe a failed matcher: EOS only
        finished = rng.random() < 0.05  # skipped
        reqs.append(SimpleNamespace(request_id=f"r{i}", constraints=state, output_token_ids=ids,
                                    eos_token_ids=[EOS], is_finished=finished))  # fmt: skip
    return reqs


def _per_row(reqs, so) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """token_masks with every matcher filled row by row (as a backend without a batch fill)."""
    matchers = [r.constraints.matcher for r in reqs if r.constraints.matcher is not None]
    fillers = [m.batch_filler for m in matchers]
    for m in matchers:
        m.batch_filler = None
    try:
        return token_masks(list(reqs), so)
    finally:
        for m, filler in zip(matchers, fillers, strict=True):
            m.batch_filler = filler


@pytest.mark.parametrize("vocab_size", [1061, 960])  # wider, narrower than the tokenizer
def test_batch_masks_are_bit_identical_to_the_per_row_masks(tokenizer, vocab_size):
    structured = StructuredOutputs(tokenizer, vocab_size, [EOS], fill_threads=2)
    rng = np.random.default_rng(vocab_size)
    batched_rows = settled = 0
    for _ in range(12):
        reqs = _requests(structured, rng, 24)
        drafts = {r.request_id: _drafts(r.constraints, r.output_token_ids, rng) for r in reqs}
        drafts = {k: v for k, v in drafts.items() if v}
        so = SchedulerOutput(scheduled_spec_decode_tokens=drafts)
        reference, dead_reference = _per_row(reqs, so)
        masks, dead_ends = token_masks(list(reqs), so)
        assert masks.keys() == reference.keys() and dead_ends == dead_reference
        for rid, rows in reference.items():
            assert masks[rid].shape == rows.shape and (masks[rid] == rows).all(), rid
        assert any(not (r == ALL_ALLOWED).all() for r in reference.values())
        again, _ = _per_row(reqs, so)  # the batch left every matcher where it was
        assert all((again[rid] == rows).all() for rid, rows in reference.items())
        live = [r for r in reqs if not r.is_finished]
        lists = [drafts.get(r.request_id, []) for r in live]
        block = np.full((sum(1 + len(d) for d in lists), live[0].constraints.num_words),
                        ALL_ALLOWED, np.uint32)  # fmt: skip
        filled = fill_batched(live, lists, block)
        batched_rows += sum(f is not None for f in filled)
        settled += sum(f is None and r.constraints.matcher is not None
                       for f, r in zip(filled, live, strict=True))  # fmt: skip
    # The batch settles every request with a grammar (the per-row path only those it cannot:
    # a library that refuses a token its own mask allowed).
    assert batched_rows > 0 and settled == 0


def test_no_fill_threads_fill_row_by_row_and_a_negative_count_is_refused(tokenizer):
    spec = StructuredOutputs(tokenizer, 1061, [EOS]).check(SamplingParams(**PARAMS[0]))
    assert spec.new_state().matcher.batch_filler is None  # fill_threads=0, the default
    with pytest.raises(ValueError, match="fill_threads must be >= 0, got -1"):
        LLGuidanceBackend(tokenizer, 1061, [EOS], fill_threads=-1)


def test_the_filler_refuses_rows_of_another_width_or_past_the_block(tokenizer):
    structured = StructuredOutputs(tokenizer, 1061, [EOS], fill_threads=2)
    state = structured.check(SamplingParams(**PARAMS[1])).new_state()
    filler = state.matcher.batch_filler
    assert isinstance(filler, LLGuidanceBatchFiller)
    with pytest.raises(ValueError, match="out rows have 33 words, the tokenizer's 34"):
        filler.fill_rows([(state.matcher, 0, [])], np.zeros((1, 33), np.uint32))
    with pytest.raises(ValueError, match="draft rows pass out's 2 rows"):
        filler.fill_rows([(state.matcher, 0, [5, 6])], np.zeros((2, 34), np.uint32))
