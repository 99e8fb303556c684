"""PenaltyLists: the host side of the sampler's penalties, per slot of the persistent batch.

A slot whose request has a presence, frequency or repetition penalty tracks the distinct token
ids of its prompt and outputs and their counts among the outputs; SamplingInputs
(sampling_metadata.py) gathers them into each step's SamplingMetadata.
"""

from __future__ import annotations

import numpy as np

# The host penalty buffers start this wide and double (up to the capacity) when a list outgrows
# them: host memory follows the longest list seen. The device width is fixed (variant_widths).
MIN_PENALTY_WIDTH = 256


def _bucket_width(needed: int, minimum: int, capacity: int | None = None) -> int:
    """0 when nothing is needed, else the next power of two >= max(needed, minimum), capped."""
    if needed == 0:
        return 0
    width = 1 << (max(needed, minimum) - 1).bit_length()
    return width if capacity is None else min(width, capacity)


class PenaltyLists:
    """Per slot whose request has a penalty: the distinct token ids of prompt + outputs (columns
    ``[0, num[slot])``, in order of first appearance after the sorted prompt) and their counts
    among the outputs; a dict per slot maps a token to its column, so an append costs O(1).

    Columns past a slot's count hold -1 / 0, so a gather of rows needs no mask. The buffers start
    at the smallest width bucket and grow to the next bucket (up to capacity) when a slot outgrows
    them: host memory follows the longest list seen, not max_model_len.
    """

    def __init__(self, num_slots: int, capacity: int) -> None:
        self.capacity = capacity
        self.ids = np.full((num_slots, min(MIN_PENALTY_WIDTH, capacity)), -1, np.int32)
        self.counts = np.zeros_like(self.ids)
        self.num = np.zeros(num_slots, np.int32)
        self.tracked = np.zeros(num_slots, bool)
        self._cols: list[dict[int, int]] = [{} for _ in range(num_slots)]

    def set(self, slot: int, prompt: np.ndarray, outputs: np.ndarray) -> None:
        seen = np.unique(np.concatenate([prompt, outputs]))
        if seen.size > self.capacity:  # checked before anything changes
            raise ValueError(
                f"SamplingInputs.set_request: {seen.size} distinct tokens exceed "
                f"penalty_capacity={self.capacity}"
            )
        self.reset(slot)
        self._ensure_width(seen.size)
        out_ids, out_counts = np.unique(outputs, return_counts=True)
        self.ids[slot, : seen.size] = seen
        self.counts[slot, np.searchsorted(seen, out_ids)] = out_counts
        self.num[slot] = seen.size
        self._cols[slot] = dict(zip(seen.tolist(), range(seen.size), strict=True))
        self.tracked[slot] = True

    def reset(self, slot: int) -> None:
        num = self.num[slot]
        self.ids[slot, :num] = -1
        self.counts[slot, :num] = 0
        self.num[slot] = 0
        self._cols[slot] = {}
        self.tracked[slot] = False

    def append(self, slots: list[int], tokens: list[int]) -> None:
        """Count one output token per (slot, token) pair; every slot must be tracked."""
        cols = [self._column(slot, token) for slot, token in zip(slots, tokens, strict=True)]
        np.add.at(self.counts, (np.array(slots, np.int64), np.array(cols, np.int64)), 1)

    def gather(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``idx`` at the buffer width (0 when none is tracked): (i32[R, w], i32[R, w])."""
        width = self.ids.shape[1] if self.num[idx].max() else 0
        return self.ids[idx, :width], self.counts[idx, :width]

    def _column(self, slot: int, token: int) -> int:
        cols = self._cols[slot]
        col = cols.get(token)
        if col is None:
            col = len(cols)
            if col == self.capacity:
                raise ValueError(
                    f"SamplingInputs: slot {slot} has more than penalty_capacity="
                    f"{self.capacity} distinct tokens"
                )
            self._ensure_width(col + 1)
            cols[token] = col
            self.ids[slot, col] = token
            self.num[slot] = col + 1
        return col

    def _ensure_width(self, needed: int) -> None:
        width = self.ids.shape[1]
        if needed <= width:
            return
        grown = _bucket_width(needed, MIN_PENALTY_WIDTH, self.capacity)
        pad = ((0, 0), (0, grown - width))
        self.ids = np.pad(self.ids, pad, constant_values=-1)
        self.counts = np.pad(self.counts, pad)
