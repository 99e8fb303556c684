"""NeutralLists: the sampler's list inputs of rows that have none, made once per row count and
kept on the device.

A batch takes the sampler's list variant (sampling_metadata.py) when any row needs one of its
lists: a penalty, a ban, or a token constraint (a grammar's mask, allowed ids, a logit bias).
Its other lists are then neutral at their full widths: penalty ids and counts i32[R, W], ban
lists i32[R, B], bias ids and values i32 / f32[R, NB] (NB = MAX_LOGIT_BIAS_TOKENS), ~340 KB at
R = 32 against a grammar's 4 KB mask on a 1024-token vocabulary. Filling and sending them every
step was most of what the list variant cost over the unconstrained step on the host
(docs/benchmarks.md, "Structured outputs"). Here each neutral array is made once per R,
read-only, and sent to the device once: ``host`` gives the arrays SamplingInputs.build puts in
a batch's metadata, ``on_device`` swaps those (by identity) for their device copies just before
the jitted step.

The device copies are uncommitted (``jax.device_put`` without a target), as a numpy argument
is, so the jitted step sees the same argument kind as the warm-up's and compiles nothing new,
and a program whose inputs are sharded otherwise (tensor parallelism: replicated on the mesh;
an executable loaded from the store) moves them as it moves a numpy argument (jax checks the
sharding of committed arrays only).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from jaxserve.sampling_constraints import MAX_LOGIT_BIAS_TOKENS


class NeutralRows(NamedTuple):
    """Read-only neutral lists of R rows (SamplingMetadata's field names)."""

    penalty_token_ids: np.ndarray  # i32[R, W] all -1
    penalty_output_counts: np.ndarray  # i32[R, W] all 0
    banned_token_ids: np.ndarray  # i32[R, B] all -1
    bias_token_ids: np.ndarray  # i32[R, NB] all -1
    bias_values: np.ndarray  # f32[R, NB] all 0


class NeutralLists:
    """Neutral list inputs at the list variant's widths, per row count.

    Args:
        penalty_width: W, the penalty lists' width in the list variant.
        ban_width: B, the ban lists' width in the list variant.
    """

    def __init__(self, penalty_width: int, ban_width: int) -> None:
        self.penalty_width = penalty_width
        self.ban_width = ban_width
        self._host: dict[int, NeutralRows] = {}
        self._device: dict[int, jax.Array] = {}  # id(host array) -> its device copy

    def host(self, num_rows: int) -> NeutralRows:
        """The neutral lists of ``num_rows`` rows: the same read-only arrays every time."""
        rows = self._host.get(num_rows)
        if rows is None:
            w, b, nb = self.penalty_width, self.ban_width, MAX_LOGIT_BIAS_TOKENS
            rows = NeutralRows(
                np.full((num_rows, w), -1, np.int32),
                np.zeros((num_rows, w), np.int32),
                np.full((num_rows, b), -1, np.int32),
                np.full((num_rows, nb), -1, np.int32),
                np.zeros((num_rows, nb), np.float32),
            )
            for array in rows:
                array.flags.writeable = False
            self._host[num_rows] = rows
        return rows

    def on_device(self, md):  # SamplingMetadata -> SamplingMetadata
        """``md`` with each field that is one of ``host``'s arrays replaced by its device copy
        (sent once); ``md`` itself when it has none."""
        swapped = {}
        for name in NeutralRows._fields:
            value = getattr(md, name)
            if isinstance(value, np.ndarray) and not value.flags.writeable:
                host = self._host.get(value.shape[0])
                if host is not None and getattr(host, name) is value:
                    swapped[name] = self._device_copy(value)
        return dataclasses.replace(md, **swapped) if swapped else md

    def _device_copy(self, value: np.ndarray) -> jax.Array:
        device = self._device.get(id(value))
        if device is None:
            device = self._device[id(value)] = jax.device_put(value)
        return device
