"""Host-side builder of SamplingMetadata: per-slot buffers, padding, penalty and ban lists."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.runner.sampling_metadata import SamplingInputs, SamplingMetadata
from jaxserve.sampling_params import MAX_BANNED_STOP_TOKEN_IDS, SamplingParams

V = 32
PENALISED = SamplingParams(repetition_penalty=1.2)


def _build(inputs: SamplingInputs, slots: list[int], padded: int, pos: list[int] | None = None):
    pos = [0] * len(slots) if pos is None else pos
    return inputs.build(np.array(slots, np.int32), padded, np.array(pos, np.int32))


def _lists(md: SamplingMetadata, row: int) -> dict[int, int]:
    ids, counts = md.penalty_token_ids[row], md.penalty_output_counts[row]
    live = ids >= 0
    assert np.all(counts[~live] == 0) and np.all(ids[: live.sum()] >= 0)  # real entries first
    assert len(set(ids[live].tolist())) == live.sum()  # unique within the row
    return dict(zip(ids[live].tolist(), counts[live].tolist(), strict=True))


def test_settings_are_gathered_and_padding_rows_are_neutral() -> None:
    inputs = SamplingInputs(4, V, 128)
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, presence_penalty=0.5)
    inputs.set_request(2, params, 2**63 - 1, [1, 2])
    inputs.set_request(0, SamplingParams(top_k=100, frequency_penalty=-1.0), 5, [3])
    md = _build(inputs, [2, 0], 4, [7, 0])
    np.testing.assert_allclose(md.temperature, [0.7, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(md.top_k, [5, V, V, V])  # above V means off
    np.testing.assert_allclose(md.top_p, [0.9, 1, 1, 1])
    np.testing.assert_allclose(md.min_p, [0.1, 0, 0, 0])
    np.testing.assert_allclose(md.presence_penalty, [0.5, 0, 0, 0])
    np.testing.assert_allclose(md.frequency_penalty, [0, -1, 0, 0])
    np.testing.assert_allclose(md.repetition_penalty, [1, 1, 1, 1])
    np.testing.assert_array_equal(md.seeds, [[2**31 - 1, 2**32 - 1], [0, 5], [0, 0], [0, 0]])
    np.testing.assert_array_equal(md.output_pos, [7, 0, 0, 0])
    assert md.seeds.dtype == np.uint32 and md.top_k.dtype == np.int32
    assert md.temperature.dtype == np.float32 and md.output_pos.dtype == np.int32
    neutral = SamplingMetadata.neutral(
        2, V, penalty_width=md.penalty_token_ids.shape[1], ban_width=md.banned_token_ids.shape[1]
    )
    for name in vars(md):
        np.testing.assert_array_equal(getattr(md, name)[2:], getattr(neutral, name), err_msg=name)


def test_tiny_temperature_is_greedy_and_drops_masks() -> None:
    inputs = SamplingInputs(2, V, 128)
    inputs.set_request(0, SamplingParams(temperature=1e-6, top_k=3, top_p=0.5, min_p=0.2), 0, [1])
    md = _build(inputs, [0], 1)
    assert (md.temperature[0], md.top_k[0], md.top_p[0], md.min_p[0]) == (0.0, V, 1.0, 0.0)
    assert md.num_logprobs[0] == -1


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=20),
    before=st.lists(st.integers(0, V - 1), max_size=10),
    after=st.lists(st.integers(0, V - 1), max_size=10),
)
def test_penalty_lists_hold_prompt_and_output_counts(
    prompt: list[int], before: list[int], after: list[int]
) -> None:
    """Tokens restored at set_request (preemption) and appended later count the same."""
    inputs = SamplingInputs(3, V, 128)
    inputs.set_request(1, PENALISED, 0, prompt, before)
    inputs.set_request(0, SamplingParams(), 0, [5])  # no penalty: untracked
    inputs.append_output_tokens(np.array([1] * len(after) + [0]), np.array([*after, 5]))
    md = _build(inputs, [0, 1], 4)
    counts = Counter(before + after)
    assert _lists(md, 1) == {t: counts[t] for t in set(prompt) | set(counts)}
    assert _lists(md, 0) == {} and _lists(md, 2) == {}
    # At the variant's one width, the capacity min(129, V): -1 pads, one compiled shape.
    assert md.penalty_token_ids.shape[1] == inputs.penalty_capacity == V


def test_penalty_width_is_zero_without_penalty_rows_and_the_capacity_otherwise() -> None:
    vocab = 4096
    inputs = SamplingInputs(4, vocab, 2000)
    inputs.set_request(0, SamplingParams(), 0, [1, 2, 3])
    inputs.set_request(1, PENALISED, 0, list(range(300)))
    inputs.set_request(3, PENALISED, 0, list(range(1500)))
    assert _build(inputs, [0], 8).penalty_token_ids.shape == (8, 0)  # row 1 is not sampling
    # Short lists or long: the capacity min(max_model_len + 1, V), the one width warmed up.
    assert _build(inputs, [0, 1], 8).penalty_token_ids.shape == (8, 2001)
    assert _build(inputs, [3, 1], 8).penalty_output_counts.shape == (8, 2001)
    inputs.append_output_token(1, 4000)
    assert _lists(_build(inputs, [1], 1), 0)[4000] == 1
    with pytest.raises(ValueError, match="penalty_capacity=2001"):
        inputs.set_request(1, SamplingParams(presence_penalty=1.0), 9, list(range(2002)))
    before = _build(inputs, [1], 1)  # the failed call changed nothing
    assert before.presence_penalty[0] == 0.0 and before.seeds[0, 1] == 0
    assert _lists(before, 0) == {**dict.fromkeys(range(300), 0), 4000: 1}


def test_penalty_buffers_grow_when_outputs_outgrow_them() -> None:
    inputs = SamplingInputs(3, 4096, 2000)
    inputs.set_request(0, PENALISED, 0, list(range(200)))
    inputs.set_request(2, PENALISED, 0, [7, 9])
    new = np.arange(3000, 3100)  # slot 0 reaches 300 distinct tokens: past the first bucket
    inputs.append_output_tokens(np.r_[np.zeros(100, int), 1, 2], np.r_[new, 7, 7])
    inputs.append_output_tokens(np.array([0, 2]), np.array([3000, 9]))
    md = _build(inputs, [2, 0, 1], 4)
    assert md.penalty_token_ids.shape == (4, inputs.penalty_capacity)
    assert _lists(md, 0) == {7: 1, 9: 1}
    assert _lists(md, 1) == {**dict.fromkeys(range(200), 0), **dict.fromkeys(new, 1), 3000: 2}
    assert _lists(md, 2) == {}


def test_bans_only_until_min_tokens() -> None:
    inputs = SamplingInputs(4, V, 128, eos_token_ids=[2])
    inputs.set_request(0, SamplingParams(min_tokens=3, stop_token_ids=[9, V + 5]), 0, [1])
    inputs.set_request(1, SamplingParams(min_tokens=3, ignore_eos=True), 0, [1])
    inputs.set_request(2, SamplingParams(stop_token_ids=[9]), 0, [1])  # min_tokens 0: no ban
    md = _build(inputs, [0, 1, 2], 4, [2, 0, 0])
    assert md.banned_token_ids.shape == (4, inputs.ban_width) == (4, MAX_BANNED_STOP_TOKEN_IDS + 1)
    assert sorted(set(md.banned_token_ids[0].tolist()) - {-1}) == [2, 9]  # V + 5 can never occur
    assert np.all(md.banned_token_ids[1:] == -1)  # ignore_eos: EOS is no stop, nothing to ban
    assert _build(inputs, [0, 2], 2, [3, 0]).banned_token_ids.shape == (2, 0)  # min_tokens reached
    # The most stop ids SamplingParams accepts with min_tokens, and EOS: the same width.
    many = list(range(3, 3 + MAX_BANNED_STOP_TOKEN_IDS))
    inputs = SamplingInputs(4, 4 * MAX_BANNED_STOP_TOKEN_IDS, 128, eos_token_ids=[2])
    inputs.set_request(3, SamplingParams(min_tokens=1, stop_token_ids=many), 0, [1])
    inputs.set_request(0, SamplingParams(min_tokens=3, stop_token_ids=[9]), 0, [1])
    md = _build(inputs, [3, 0], 2)
    assert md.banned_token_ids.shape == (2, inputs.ban_width)
    assert sorted(set(md.banned_token_ids[0].tolist()) - {-1}) == sorted([2, *many])
    assert sorted(set(md.banned_token_ids[1].tolist()) - {-1}) == [2, 9]


def test_a_ban_list_past_its_width_is_refused_before_anything_changes() -> None:
    inputs = SamplingInputs(2, 4 * MAX_BANNED_STOP_TOKEN_IDS, 128, eos_token_ids=[0])
    params = SamplingParams(min_tokens=2)
    params.stop_token_ids = list(range(1, 2 + MAX_BANNED_STOP_TOKEN_IDS))  # bypasses clone()
    params.all_stop_token_ids = frozenset(params.stop_token_ids)
    with pytest.raises(ValueError, match=f"exceed ban_width={MAX_BANNED_STOP_TOKEN_IDS + 1}"):
        inputs.set_request(1, params, 3, [1])
    md = _build(inputs, [1], 1)
    assert md.banned_token_ids.shape == (1, 0) and md.seeds[0, 1] == 0


def test_clear_and_reuse_leave_nothing_behind() -> None:
    inputs = SamplingInputs(2, V, 128, eos_token_ids=[0])
    params = SamplingParams(temperature=0.5, min_tokens=4, presence_penalty=1.0, logprobs=3)
    inputs.set_request(1, params, 77, [4, 5, 6], [7])
    inputs.clear(1)
    inputs.append_output_token(1, 3)  # a cleared slot tracks nothing
    cleared = _build(inputs, [1], 2)
    neutral = SamplingMetadata.neutral(2, V)
    for field in vars(cleared):
        np.testing.assert_array_equal(getattr(cleared, field), getattr(neutral, field))
    inputs.set_request(1, PENALISED, 1, [8])
    assert _lists(_build(inputs, [1], 1), 0) == {8: 0}
    assert _build(inputs, [1], 1).num_logprobs[0] == -1


def test_logprobs_asked_per_row() -> None:
    inputs = SamplingInputs(3, V, 128)
    inputs.set_request(0, SamplingParams(temperature=0.0, logprobs=3), 0, [1])
    inputs.set_request(1, SamplingParams(temperature=0.0, logprobs=0), 0, [1])
    inputs.set_request(2, SamplingParams(), 0, [1])
    assert _build(inputs, [0, 1, 2], 4).num_logprobs.tolist() == [3, 0, -1, -1]


def test_penalty_and_ban_lists_come_together_at_their_minimum_widths() -> None:
    """A batch has both lists or neither, each at one width, so every batch shape has two
    compiled variants."""
    inputs = SamplingInputs(3, V, 128, eos_token_ids=[0])
    inputs.set_request(0, SamplingParams(), 0, [1])
    inputs.set_request(1, PENALISED, 0, [1, 2])
    inputs.set_request(2, SamplingParams(min_tokens=2), 0, [1])
    widths = lambda md: (md.penalty_token_ids.shape[1], md.banned_token_ids.shape[1])  # noqa: E731
    assert widths(_build(inputs, [0], 2)) == inputs.variant_widths[0] == (0, 0)
    for slots in ([1], [2], [0, 1, 2]):
        assert widths(_build(inputs, slots, 4)) == inputs.variant_widths[1] == (V, 65)


def test_bad_inputs_raise() -> None:
    inputs = SamplingInputs(2, V, 128)
    with pytest.raises(ValueError, match="slot must be in"):
        inputs.set_request(2, SamplingParams(), 0, [1])
    with pytest.raises(ValueError, match="prompt_token_ids must be in"):
        inputs.set_request(0, SamplingParams(), 0, [V])
    with pytest.raises(ValueError, match="seed must be in"):
        inputs.set_request(0, SamplingParams(), -1, [1])
    with pytest.raises(ValueError, match="padded_rows=1 < num_rows=2"):
        _build(inputs, [0, 1], 1)
    with pytest.raises(ValueError, match="same length"):
        inputs.build(np.array([0, 1]), 2, np.array([0]))
    with pytest.raises(ValueError, match="slot_indices must be in"):
        _build(inputs, [0, 5], 2)
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingInputs(2, 0, 128)
