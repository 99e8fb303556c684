"""Token constraints in the sampler: a packed allowed-token bitmask and a logit bias per row.

Host side, ``ConstraintRows`` keeps what each slot's request fixes for its whole life
(``allowed_token_ids`` as a bitmask row, ``logit_bias`` as id / value lists) and gathers, each
step, the sampling rows' bitmask (the step's mask from the engine where there is one: a
grammar, bad words, with the allowed ids folded in; SchedulerOutput.token_masks, one row per
verification row of a request with speculative drafts; else that row) and biases. Device
side, ``apply_token_constraints`` adds the biases and sets every token outside the bitmask to
-inf, inside the one jitted step before sampling.

Shapes: the bitmask is u32[R, M] with M = ceil(V / 32) (bit ``t % 32`` of word ``t // 32`` is
token t; V is the model's logits width, which may exceed the tokenizer's vocabulary), the biases
i32 / f32[R, NB] with NB = MAX_LOGIT_BIAS_TOKENS. Both take the sampler's list variant
(sampling_metadata.py): widths 0 in a batch without any list, full widths otherwise, so no
request compiles anything new; a batch whose rows are all unconstrained skips the [R, V] pass
at run time (lax.cond).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.runner.neutral_lists import NeutralLists
from jaxserve.sampling_constraints import MAX_LOGIT_BIAS_TOKENS
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured.bitmask import ALL_ALLOWED, bitmask_words, token_bitmask

__all__ = [
    "ALL_ALLOWED",
    "ConstraintRows",
    "apply_token_constraints",
    "bitmask_words",
    "token_bitmask",
]


class ConstraintRows:
    """Per-slot allowed-token bitmasks and logit biases (only for slots that have them).

    Args:
        vocab_size: V, the model's logits width.
        neutral: where a batch without a bias takes its bias arrays (neutral_lists.py); None:
            fresh ones each step.
    """

    def __init__(self, vocab_size: int, neutral: NeutralLists | None = None) -> None:
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self.bias_width = MAX_LOGIT_BIAS_TOKENS
        self._allowed: dict[int, np.ndarray] = {}  # slot -> u32[M]
        self._bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # slot -> (i32[k], f32[k])
        self._neutral = neutral

    def set(self, slot: int, params: SamplingParams) -> None:
        """Take ``slot``'s constraints from its request's params (none: the slot is free).

        Raises:
            ValueError: an id outside [0, V), more biases than NB (the engine checked both
                when the request was queued: a mutated copy).
        """
        self.reset(slot)
        v = self.vocab_size
        if params.allowed_token_ids is not None:
            ids = params.allowed_token_ids
            if min(ids) < 0 or max(ids) >= v:
                raise ValueError(f"ConstraintRows.set: allowed_token_ids must be in [0, {v})")
            self._allowed[slot] = token_bitmask(ids, v)
        if params.logit_bias:
            bias = params.logit_bias
            if len(bias) > self.bias_width or not all(0 <= t < v for t in bias):
                raise ValueError(
                    f"ConstraintRows.set: logit_bias needs at most {self.bias_width} ids in "
                    f"[0, {v})"
                )
            self._bias[slot] = (
                np.fromiter(bias.keys(), np.int32, len(bias)),
                np.fromiter(bias.values(), np.float32, len(bias)),
            )

    def reset(self, slot: int) -> None:
        self._allowed.pop(slot, None)
        self._bias.pop(slot, None)

    def any_in(self, slots: np.ndarray) -> bool:
        """Whether some slot of ``slots`` has a bitmask or a bias (a cheap per-step test)."""
        if not self._allowed and not self._bias:
            return False
        return any(s in self._allowed or s in self._bias for s in slots.tolist())

    def gather(
        self, slots: np.ndarray, step_masks: Mapping[int, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step's rows: (bitmask u32[R, M], bias ids i32[R, NB] (-1 pads), bias values
        f32[R, NB]) for ``slots`` i64[R] (padding rows name no slot of ours: unconstrained);
        ``step_masks``: slot -> u32[M], the engine's whole mask of this step for the slot (its
        allowed ids included), used instead of the slot's allowed-ids row; or u32[1 + k, M]
        for a slot verifying k drafts, whose k + 1 rows come one after the other in ``slots``
        (spec_rows.logits_row_owners): its j-th row takes mask row j. Biases are the same on
        every row of a slot."""
        num_rows = slots.shape[0]
        bitmask = np.full((num_rows, self.num_words), ALL_ALLOWED, np.uint32)
        slot_list = slots.tolist()
        allowed = self._allowed
        seen: dict[int, int] = {}  # slot -> its rows so far (a 2-D mask's row index)
        for row, slot in enumerate(slot_list):
            # The engine's step mask already holds the request's allowed ids (and may allow
            # only EOS where nothing else is left: structured/step_masks.py).
            mask = step_masks.get(slot)
            if mask is not None and mask.ndim == 2:
                j = seen[slot] = seen.get(slot, -1) + 1
                mask = mask[j]
            elif mask is None and allowed:
                mask = allowed.get(slot)
            if mask is not None:
                bitmask[row] = mask
        return bitmask, *self._gather_biases(slot_list)

    def _gather_biases(self, slot_list: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(bias ids i32[R, NB] (-1 pads), bias values f32[R, NB]) of the rows' slots; for a
        batch without a bias, the neutral pair of ``neutral`` where there is one (no fill)."""
        num_rows = len(slot_list)
        biased = [(row, self._bias[s]) for row, s in enumerate(slot_list) if s in self._bias]
        if not biased and self._neutral is not None:
            rows = self._neutral.host(num_rows)
            return rows.bias_token_ids, rows.bias_values
        bias_ids = np.full((num_rows, self.bias_width), -1, np.int32)
        bias_values = np.zeros((num_rows, self.bias_width), np.float32)
        for row, (ids, values) in biased:
            bias_ids[row, : ids.size] = ids
            bias_values[row, : values.size] = values
        return bias_ids, bias_values


def apply_token_constraints(
    x: jax.Array, bitmask: jax.Array, bias_ids: jax.Array, bias_values: jax.Array
) -> jax.Array:
    """Logit biases, then the bitmask: f32[R, V] -> f32[R, V], tokens outside it at -inf.

    Widths 0 (the list-free variant) return ``x`` untouched; otherwise each part runs only when
    some row has it (lax.cond: a run-time test, nothing compiles per batch).
    """
    num_rows, vocab = x.shape
    if bitmask.shape[1] == 0:
        return x
    x = jnp.asarray(x)
    rows = jnp.arange(num_rows)[:, None]

    def add_bias() -> jax.Array:
        ids = jnp.where(bias_ids >= 0, bias_ids, vocab)  # padding points past V: dropped
        return x.at[rows, ids].add(bias_values, mode="drop")

    x = lax.cond(jnp.any(bias_ids >= 0), add_bias, lambda: x)

    def mask() -> jax.Array:
        tokens = jnp.arange(vocab, dtype=jnp.uint32)
        words = jnp.take(bitmask, (tokens >> 5).astype(jnp.int32), axis=1)  # u32[R, V]
        allowed = ((words >> (tokens & 31)) & 1).astype(bool)
        return jnp.where(allowed, x, -jnp.inf)

    return lax.cond(jnp.any(bitmask != ALL_ALLOWED), mask, lambda: x)
