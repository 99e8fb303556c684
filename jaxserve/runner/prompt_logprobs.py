"""Prompt logprobs on the runner's side: which rows of a step owe them, the step's targets
input, and the host-side collection of what the step computed.

A request that asks for prompt logprobs (SamplingParams.prompt_logprobs) is owed, for every
prompt position p < num_prompt - 1, the logprob of prompt token p + 1. Its prompt may run over
several steps (chunked prefill), and be preempted and recomputed: each position is emitted
once, in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.outputs import ModelRunnerOutput
from jaxserve.runner.input_batch import InputBatch, PreparedBatch
from jaxserve.runner.sampler import logprobs_width, to_token_logprobs


@dataclass
class _PromptLogprobsState:
    num: int  # top-N asked
    next_pos: int = 0  # next position whose prediction (of prompt token next_pos + 1) is owed
    done: bool = False

    def advance(self, next_pos: int | None, num_prompt: int) -> None:
        """Positions before ``next_pos`` are emitted (None: none this step); done once every
        owed one is."""
        if next_pos is not None:
            self.next_pos = next_pos
        if self.next_pos >= num_prompt - 1:
            self.done = True


class PromptLogprobs:
    """The prompt-logprobs progress of every request that asked for them: kept across
    preemption, dropped when the request finishes.

    Args:
        vocab_size: the model's vocabulary (the widest top-N is logprobs_width of it).
    """

    def __init__(self, vocab_size: int) -> None:
        self.width = logprobs_width(vocab_size)
        self._states: dict[str, _PromptLogprobsState] = {}  # req_id -> progress

    def __bool__(self) -> bool:
        return bool(self._states)

    def add(self, req_id: str, num: int) -> None:
        """Owe ``req_id`` its top-``num`` prompt logprobs (a resumed request keeps its
        progress)."""
        self._states.setdefault(req_id, _PromptLogprobsState(num))

    def drop(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def targets(self, batch: PreparedBatch, ib: InputBatch) -> np.ndarray:
        """i32[T] next prompt token of every scheduled row of a request that still owes prompt
        logprobs, -1 elsewhere (all -1: the step computes no prompt logprobs)."""
        targets = np.full(batch.input_ids.shape, -1, np.int32)
        for row, start, n in self._rows_owing(batch):
            slot = batch.slots[row]
            nxt = batch.positions[start : start + n] + 1  # the token each position predicts
            ok = nxt < ib.num_prompt_tokens[slot]
            targets[start : start + n] = np.where(ok, ib.token_ids[slot, np.where(ok, nxt, 0)], -1)
        return targets

    def owed_in(self, batch: PreparedBatch) -> bool:
        """Whether some row of ``batch`` computed prompt logprobs still owed."""
        return any(True for _ in self._rows_owing(batch))

    def collect(
        self, batch: PreparedBatch, plp: Any, ib: InputBatch, result: ModelRunnerOutput
    ) -> None:
        """Prompt logprobs of the positions computed this step (``plp``, on the host) into
        ``result``, each emitted once (a request preempted mid-prompt recomputes positions it
        already reported: they are skipped)."""
        for row, start, n in list(self._rows_owing(batch)):
            req_id = batch.req_ids[row]
            state = self._states[req_id]
            num_prompt = int(ib.num_prompt_tokens[batch.slots[row]])
            first = int(batch.positions[start])
            # Position p predicts prompt token p + 1; emit p in [state.next_pos, num_prompt - 1).
            lo = max(first, state.next_pos)
            hi = min(first + n, num_prompt - 1)
            if hi > lo:
                rows = np.arange(start + lo - first, start + hi - first)
                result.prompt_logprobs[req_id] = to_token_logprobs(
                    plp.logprobs[rows],
                    plp.token_ids[rows],
                    plp.ranks[rows],
                    min(state.num, self.width),
                )
            state.advance(hi if hi > lo else None, num_prompt)

    def _rows_owing(self, batch: PreparedBatch) -> Iterator[tuple[int, int, int]]:
        """(row, first token row, scheduled tokens) of requests still owed prompt logprobs."""
        if not self._states:
            return
        starts = batch.cu_q_lens
        for row, req_id in enumerate(batch.req_ids):
            state = self._states.get(req_id)
            if state is not None and not state.done:
                yield row, int(starts[row]), int(batch.num_scheduled[row])
