"""Token constraints in the sampler (jaxserve/runner/token_constraints.py): the per-slot
bitmask and biases, the step's masks, and their use inside ``sample`` in the sampler's list
variant (no new compiled shape)."""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.runner.sampler import sample
from jaxserve.runner.sampling_metadata import SamplingInputs
from jaxserve.runner.token_constraints import (
    ALL_ALLOWED,
    apply_token_constraints,
    bitmask_words,
    token_bitmask,
)
from jaxserve.sampling_params import SamplingParams

V = 1061  # not a multiple of 32: the last word is partly padding


def _shapes(md):
    return jax.tree.map(lambda a: (np.shape(a), np.asarray(a).dtype), md)


def test_bitmask_and_bias_on_device():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, V)).astype(np.float32)
    bitmask = np.full((3, bitmask_words(V)), ALL_ALLOWED, np.uint32)
    bitmask[0] = token_bitmask([0, 31, 32, 1060], V)
    bias_ids = np.full((3, 4), -1, np.int32)
    bias_values = np.zeros((3, 4), np.float32)
    bias_ids[1, :2], bias_values[1, :2] = [7, 1060], [100.0, -100.0]
    out = np.asarray(apply_token_constraints(x, bitmask, bias_ids, bias_values))
    assert np.isfinite(out[0]).sum() == 4
    np.testing.assert_array_equal(out[0, [0, 31, 32, 1060]], x[0, [0, 31, 32, 1060]])
    np.testing.assert_allclose(out[1, [7, 1060]], x[1, [7, 1060]] + [100, -100], rtol=1e-6)
    np.testing.assert_array_equal(np.delete(out[1], [7, 1060]), np.delete(x[1], [7, 1060]))
    np.testing.assert_array_equal(out[2], x[2])  # an unconstrained row is untouched


def test_constrained_batches_take_the_list_variant_and_sample_inside_the_mask():
    inputs = SamplingInputs(4, V, 64)
    inputs.set_request(0, SamplingParams(temperature=0.0), 0, [1])
    inputs.set_request(1, SamplingParams(repetition_penalty=1.2), 0, [1])
    inputs.set_request(2, SamplingParams(temperature=1.0, allowed_token_ids=[5, 6]), 3, [1])
    inputs.set_request(3, SamplingParams(temperature=0.0, logit_bias={9: 1e4}), 0, [1])
    pos = np.zeros(1, np.int32)
    plain = inputs.build(np.array([0]), 4, pos)
    penalised = inputs.build(np.array([1]), 4, pos)
    assert _shapes(plain) != _shapes(penalised)
    step_mask = {0: token_bitmask([11, 12], V)}  # a grammar's mask for slot 0 this step
    constrained = inputs.build(np.arange(4), 4, np.zeros(4, np.int32), step_mask)
    assert _shapes(constrained) == _shapes(penalised)  # the same compiled variant
    logits = np.zeros((4, V), np.float32)
    logits[:, 100] = 50.0  # every row's favourite, outside the masks
    for _ in range(3):
        tokens = np.asarray(sample(jax.numpy.asarray(logits), constrained).token_ids)
        assert tokens[0] in (11, 12) and tokens[1] == 100 and tokens[2] in (5, 6)
        assert tokens[3] == 9  # a +1e4 bias beats the favourite
    inputs.clear(2)
    inputs.clear(3)
    assert _shapes(inputs.build(np.array([2, 3]), 4, np.zeros(2, np.int32))) == _shapes(plain)


def test_a_speculating_slot_takes_one_mask_row_per_verification_row():
    """A request verifying k drafts owns k + 1 consecutive rows (spec_rows.logits_row_owners);
    its step mask u32[k + 1, M] gives row j its mask row j; biases repeat on every row."""
    inputs = SamplingInputs(max_num_seqs=4, vocab_size=V, max_model_len=64)
    inputs.set_request(1, SamplingParams(logit_bias={9: 2.0}), 0, [3, 4])
    inputs.set_request(2, SamplingParams(allowed_token_ids=[7, 8]), 0, [3, 4])
    spec_masks = np.stack([token_bitmask([t], V) for t in (10, 11, 12)])
    slots = np.array([1, 1, 1, 2, 2, 3])  # slot 1: 2 drafts; slot 2: 1 draft (its own mask)
    md = inputs.build(slots, 8, np.array([0, 1, 2, 0, 1, 0]), {1: spec_masks})
    for row, want in enumerate(spec_masks):
        assert (md.token_bitmask[row] == want).all()
        assert md.bias_token_ids[row, 0] == 9 and md.bias_values[row, 0] == 2.0
    for row in (3, 4):
        assert (md.token_bitmask[row] == token_bitmask([7, 8], V)).all()
    assert (md.token_bitmask[5:] == ALL_ALLOWED).all() and (md.bias_token_ids[3:] == -1).all()
