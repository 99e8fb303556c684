"""RequestConstraints: what one scheduler request may sample next, step by step.

A request with a grammar or bad words carries one (Request.constraints); the engine core asks
it for the request's mask row before each step in which the request samples (step_masks.py),
and tells it the tokens the request accepted after the step. The matcher follows the request's
output tokens only, which survive preemption (recompute keeps them, and they are fed back as
prompt, never re-sampled), so its state needs no rollback; each sample of an n > 1 request
has its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.structured.backend import CompiledGrammar, Matcher
from jaxserve.structured.bad_words import banned_next_tokens
from jaxserve.structured.bitmask import ALL_ALLOWED, clear_bit

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
        if matcher is None:
            return None
        for token in token_ids:
            if not matcher.accept_token(token):
                return "error"
            if matcher.is_terminated():
                return "stop"
        return None
