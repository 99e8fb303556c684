"""The list variant's neutral lists (jaxserve/runner/neutral_lists.py) and the sampler's
run-time skips of penalties and bans: a constrained batch without penalties, bans or biases
reuses read-only arrays (sent to the device once) and samples exactly what fresh arrays and the
full penalty / ban pass give."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.runner.neutral_lists import NeutralLists
from jaxserve.runner.sampler import apply_penalties, sample
from jaxserve.runner.sampling_metadata import SamplingInputs, SamplingMetadata
from jaxserve.runner.token_constraints import token_bitmask
from jaxserve.sampling_params import SamplingParams

V = 1061


def _constrained_inputs() -> SamplingInputs:
    inputs = SamplingInputs(4, V, 64)
    for slot in range(4):
        inputs.set_request(slot, SamplingParams(temperature=1.0, seed=slot), slot, [1, 2])
    return inputs


def _fresh(md: SamplingMetadata) -> SamplingMetadata:
    """``md`` with every field a fresh writable copy (what the builder gave before)."""
    return jax.tree.map(lambda a: np.array(a, copy=True), md)


def test_a_batch_without_lists_reuses_the_same_read_only_arrays():
    inputs = _constrained_inputs()
    masks = {0: token_bitmask([3, 4], V)}
    first = inputs.build(np.arange(4), 4, np.zeros(4, np.int32), masks)
    second = inputs.build(np.arange(4), 4, np.ones(4, np.int32), masks)
    for name in ("penalty_token_ids", "penalty_output_counts", "banned_token_ids",
                 "bias_token_ids", "bias_values"):  # fmt: skip
        a, b = getattr(first, name), getattr(second, name)
        assert a is b and not a.flags.writeable
        assert (a == (0 if "counts" in name or "values" in name else -1)).all()
    assert first.token_bitmask.flags.writeable  # the masks are written per step (write_masks)
    assert first.token_bitmask is not second.token_bitmask


def test_rows_with_lists_get_their_own_arrays():
    inputs = _constrained_inputs()
    inputs.set_request(1, SamplingParams(presence_penalty=0.5, logit_bias={7: 2.0}), 1, [1])
    md = inputs.build(np.arange(4), 4, np.zeros(4, np.int32), {0: token_bitmask([3], V)})
    assert md.penalty_token_ids.flags.writeable and md.bias_token_ids.flags.writeable
    assert md.bias_token_ids[1, 0] == 7 and (md.bias_token_ids[[0, 2, 3]] == -1).all()
    assert not md.banned_token_ids.flags.writeable  # no ban: still the neutral one


def test_on_device_swaps_only_the_neutral_arrays_once():
    inputs = _constrained_inputs()
    md = inputs.build(np.arange(4), 4, np.zeros(4, np.int32), {0: token_bitmask([3], V)})
    on_device = inputs.neutral.on_device(md)
    again = inputs.neutral.on_device(md)
    assert isinstance(on_device.bias_values, jax.Array)
    assert on_device.bias_values is again.bias_values  # sent once
    assert on_device.token_bitmask is md.token_bitmask  # a step's own arrays stay on the host
    plain = inputs.build(np.arange(4), 4, np.zeros(4, np.int32))  # widths 0: nothing to swap
    assert inputs.neutral.on_device(plain) is plain
    lookalike = dataclasses.replace(md, bias_values=np.zeros_like(md.bias_values))
    assert inputs.neutral.on_device(lookalike).bias_values is lookalike.bias_values


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_neutral_and_device_lists_sample_what_fresh_ones_do(temperature):
    inputs = SamplingInputs(4, V, 64)
    for slot in range(4):
        inputs.set_request(slot, SamplingParams(temperature=temperature, seed=9), slot, [1])
    masks = {s: token_bitmask(range(10 * s, 10 * s + 40), V) for s in range(3)}
    md = inputs.build(np.arange(4), 4, np.arange(4, dtype=np.int32), masks)
    logits = jax.numpy.asarray(np.random.default_rng(0).normal(size=(4, V)), np.float32)
    pending = jax.numpy.asarray([5, -1, 7, 1], np.int32)
    got = sample(logits, inputs.neutral.on_device(md), pending_outputs=pending)
    want = sample(logits, _fresh(md), pending_outputs=pending)
    np.testing.assert_array_equal(np.asarray(got.token_ids), np.asarray(want.token_ids))


def test_skipped_penalties_are_exactly_the_neutral_pass():
    """A batch whose rows have no penalty returns its logits bit for bit (what the full pass
    computes for them), and a batch with one penalized row still penalizes it."""
    rng = np.random.default_rng(1)
    logits = jax.numpy.asarray(rng.normal(size=(3, V)) * 10, np.float32)
    ids = np.full((3, 8), -1, np.int32)
    ids[:, :3] = [[4, 5, 6], [7, 8, 9], [1, 2, 3]]
    md = SamplingMetadata.neutral(3, V, penalty_width=8, ban_width=2)
    md = dataclasses.replace(md, penalty_token_ids=ids, penalty_output_counts=(ids >= 0) * 2)
    pending = jax.numpy.asarray([4, 11, -1], np.int32)
    np.testing.assert_array_equal(np.asarray(apply_penalties(logits, md, pending)), logits)
    rp = np.ones(3, np.float32)
    rp[1] = 2.0
    penalized = np.asarray(
        apply_penalties(logits, dataclasses.replace(md, repetition_penalty=rp), pending)
    )
    np.testing.assert_array_equal(penalized[[0, 2]], np.asarray(logits)[[0, 2]])
    x = np.asarray(logits)[1, [7, 8, 9, 11]]
    np.testing.assert_allclose(penalized[1, [7, 8, 9, 11]], np.where(x > 0, x / 2, x * 2))


def test_neutral_lists_have_the_variant_widths():
    neutral = NeutralLists(penalty_width=65, ban_width=66)
    rows = neutral.host(8)
    assert rows.penalty_token_ids.shape == rows.penalty_output_counts.shape == (8, 65)
    assert rows.banned_token_ids.shape == (8, 66)
    assert rows.bias_token_ids.shape == rows.bias_values.shape == (8, 1024)
    assert neutral.host(8) is rows and neutral.host(16) is not rows
