"""RequestConstraints: what one scheduler request may sample next, step by step.

A request with a grammar or bad words carries one (Request.constraints); the engine core asks
it for the request's mask row before each step in which the request samples (step_masks.py),
and tells it the tokens the request accepted after the step. The matcher follows the request's
output tokens only, which survive preemption (recompute keeps them, and they are fed back as
prompt, never re-sampled), so its state needs no rollback; each sample of an n > 1 request
has its own.

With speculative decoding (draft_checks.py) the matcher also tries a step's drafts tentatively,
and rolls them back: ``num_draft_tokens`` before the drafts are scheduled, ``fill_masks`` for
the masks of the verification rows (row j: the state after drafts 0..j-1), ``run_length``
after the step; only ``accept`` advances it for good.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.structured.backend import CompiledGrammar, Matcher
from jaxserve.structured.bad_words import banned_next_tokens
from jaxserve.structured.bitmask import ALL_ALLOWED, clear_bit, has_bit

__all__ = ["ALL_ALLOWED", "ConstraintSpec", "RequestConstraints"]


@dataclass(frozen=True)
class ConstraintSpec:
    """A checked request's host-side constraints, shared by its n samples.

    grammar: the compiled structured_outputs constraint, or None.
    bad_words: token sequences of SamplingParams.bad_words (bad_words.py), or ().
    allowed: u32[num_words] bitmask of allowed_token_ids, or None (the runner applies it too;
        here it lets the host see a step where nothing at all may be sampled).
    num_words: u32 words of a mask row: ceil(V / 32) for the model's logits width V.
    backend_words: u32 words the grammar library fills (>= num_words; the ids past V are
        never sampled).
    """

    grammar: CompiledGrammar | None
    bad_words: tuple[tuple[int, ...], ...]
    num_words: int
    backend_words: int
    allowed: np.ndarray | None = None

    def new_state(self) -> RequestConstraints:
        """The per-sample state: its own matcher at the grammar's start."""
        matcher = None if self.grammar is None else self.grammar.new_matcher()
        return RequestConstraints(
            matcher, self.bad_words, self.num_words, self.backend_words, self.allowed
        )


class RequestConstraints:
    """One request's matcher and bad-word sequences (see the module docstring)."""

    def __init__(
        self,
        matcher: Matcher | None,
        bad_words: tuple[tuple[int, ...], ...],
        num_words: int,
        backend_words: int,
        allowed: np.ndarray | None = None,
    ) -> None:
        self.matcher = matcher
        self.bad_words = bad_words
        self.num_words = num_words
        self.allowed = allowed  # u32[num_words] or None; shared read-only by the n samples
        # Output tokens a bad-word match looks back at (the longest word's length - 1).
        self._lookback = max((len(s) - 1 for s in bad_words), default=0)
        # The library writes a full row of its own width; the step keeps the first num_words
        # (no scratch row when the widths agree: it writes into the step's row directly).
        self._scratch = None
        if backend_words != num_words:
            self._scratch = np.empty(max(backend_words, num_words), np.uint32)

    def fill_mask(self, out: np.ndarray, output_token_ids: list[int]) -> None:
        """Write the allowed next tokens into ``out`` (u32[num_words], contiguous, prefilled by
        the caller with ALL_ALLOWED): the grammar's mask and allowed_token_ids, less the tokens
        that would end a bad word."""
        if self.matcher is not None:
            if self._scratch is None:
                self.matcher.fill_bitmask(out)
            else:
                self.matcher.fill_bitmask(self._scratch)
                out &= self._scratch[: self.num_words]
        self._restrict(out, output_token_ids)

    def _restrict(self, out: np.ndarray, output_token_ids: list[int]) -> None:
        """``out`` (a row with the grammar's mask) less what allowed_token_ids and the bad
        words forbid after ``output_token_ids``."""
        if self.allowed is not None:
            out &= self.allowed
        if self.bad_words:
            for token in banned_next_tokens(self.bad_words, output_token_ids):
                clear_bit(out, token)

    def accept(self, token_ids: list[int]) -> str | None:
        """Advance past a step's accepted tokens. Returns "stop" once the grammar is complete,
        "error" (with the matcher's reason logged by the caller) when it rejected a token, and
        None otherwise."""
        matcher = self.matcher
        return None if matcher is None else matcher.accept_tokens(token_ids)

    # ---- speculative drafts: tried tentatively, the matcher left as it was -------------------

    def num_draft_tokens(self, output_token_ids: list[int], drafts: list[int]) -> int:
        """How many leading ``drafts`` may be verified: up to the first one that
        allowed_token_ids, a bad word or the grammar forbids, and never the one that would end
        the grammar (so that a grammar ends on a step's last sampled row, as without drafts:
        a draft past the end would be emitted)."""
        n = len(drafts)
        if self.allowed is not None:
            n = next((j for j in range(n) if not has_bit(self.allowed, drafts[j])), n)
        if self.bad_words:
            prefix = self._tail(output_token_ids)
            for j in range(n):
                if drafts[j] in banned_next_tokens(self.bad_words, prefix):
                    n = j
                    break
                prefix.append(drafts[j])
        matcher = self.matcher
        if matcher is None or n == 0:
            return n
        n = matcher.num_valid(drafts[:n])
        for j in range(n):
            matcher.accept_token(drafts[j])
            if matcher.is_terminated():
                matcher.rollback(j + 1)
                return j
        matcher.rollback(n)
        return n

    def fill_masks(self, rows: np.ndarray, output_token_ids: list[int], drafts: list[int]) -> int:
        """Write into ``rows`` (u32[1 + len(drafts), num_words], prefilled with ALL_ALLOWED)
        the mask of each verification row: row j allows what may follow the outputs and
        drafts[:j]. Filling stops after the row whose draft it forbids, and after a draft that
        ends the grammar: the rows past it stay all-allowed, and are never emitted (the draft
        is rejected there; tokens past a grammar's end are trimmed: draft_checks.run_lengths).
        Returns the rows filled (>= 1)."""
        prefix = self._tail(output_token_ids) if self.bad_words else output_token_ids
        matcher, consumed = self.matcher, 0
        try:
            for j, row in enumerate(rows):
                self.fill_mask(row, prefix)
                if j == len(drafts) or not has_bit(row, drafts[j]):
                    return j + 1
                if matcher is not None:
                    matcher.accept_token(drafts[j])  # allowed by the row: the grammar accepts
                    consumed += 1
                    if matcher.is_terminated():
                        return j + 1
                if self.bad_words:
                    prefix.append(drafts[j])
            return len(rows)
        finally:
            if consumed:
                matcher.rollback(consumed)

    def finish_masks(
        self,
        rows: np.ndarray,
        grammar_rows: np.ndarray,
        output_token_ids: list[int],
        drafts: list[int],
    ) -> int | None:
        """``fill_masks`` from the grammar's rows that the backend's BatchMaskFiller wrote
        (``grammar_rows``: u32[1 + len(drafts), backend_words], zeroed before the fill, or
        ``rows`` itself where the widths agree; the filler's rows follow the same drafts). The
        filler stops after a draft that ends the grammar too, but writes one more row there
        (EOS only) where fill_masks stops: so a row after an accepted draft that has one bit is
        checked with the matcher (rare: near a grammar's end, or where it forces one token).
        Returns the rows filled, each bit-identical to fill_masks' and the rest all-allowed;
        or None, ``rows`` all-allowed, where the library left a row unwritten after a draft its
        own mask allowed (the caller uses fill_masks)."""
        filled = self._finish(rows, grammar_rows, output_token_ids, drafts)
        if filled is None or filled < len(rows):
            rows[filled or 0 :] = ALL_ALLOWED
        return filled

    def _finish(
        self,
        rows: np.ndarray,
        grammar_rows: np.ndarray,
        output_token_ids: list[int],
        drafts: list[int],
    ) -> int | None:
        prefix = self._tail(output_token_ids) if self.bad_words else output_token_ids
        width, apart = self.num_words, grammar_rows is not rows
        for j, row in enumerate(rows):
            if apart:
                row &= grammar_rows[j, :width]
            self._restrict(row, prefix)
            if j == len(drafts) or not has_bit(row, drafts[j]):
                return j + 1
            after = grammar_rows[j + 1]
            if _at_most_one_bit(after):
                if not after.any():
                    return None
                if self._ends_grammar(drafts[: j + 1]):
                    return j + 1
            if self.bad_words:
                prefix.append(drafts[j])
        return len(rows)

    def _ends_grammar(self, token_ids: list[int]) -> bool:
        """Whether the grammar is complete after ``token_ids`` (tentatively: rolled back)."""
        matcher, consumed = self.matcher, 0
        try:
            for token in token_ids:
                if not matcher.accept_token(token):
                    return False
                consumed += 1
            return matcher.is_terminated()
        finally:
            if consumed:
                matcher.rollback(consumed)

    def run_length(self, token_ids: list[int]) -> int:
        """How many of a step's emitted ``token_ids`` to keep: up to and including the one
        that ends the grammar (all of them when none does)."""
        matcher = self.matcher
        if matcher is None or len(token_ids) < 2:
            return len(token_ids)
        n = matcher.num_valid(token_ids)
        for j in range(n):
            matcher.accept_token(token_ids[j])
            if matcher.is_terminated():
                matcher.rollback(j + 1)
                return j + 1
        matcher.rollback(n)
        return len(token_ids)

    def _tail(self, output_token_ids: list[int]) -> list[int]:
        """A copy of the outputs' last tokens that a bad word can reach back to."""
        if not self._lookback:
            return []
        return list(output_token_ids[-self._lookback :])


def _at_most_one_bit(row: np.ndarray) -> bool:
    """Whether ``row`` (u32 words) has at most one bit set."""
    words = np.flatnonzero(row)
    if len(words) > 1:
        return False
    return len(words) == 0 or (int(row[words[0]]) & (int(row[words[0]]) - 1)) == 0
