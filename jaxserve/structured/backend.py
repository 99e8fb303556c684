"""The interface a grammar library implements for jaxserve (llguidance_backend.py is the one
there is; a second library is one more module with these classes). A library that can fill
many masks in one call offers a BatchMaskFiller through its matchers' ``batch_filler``; one
without it (``batch_filler`` None) is filled row by row (RequestConstraints.fill_masks)."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Matcher(Protocol):
    """The state of one request in its grammar: which tokens may come next, and the tokens that
    came. Owned by one request (RequestConstraints); never shared."""

    # The library's batch fill for matchers of its own (shared by all of them), or None.
    batch_filler: BatchMaskFiller | None

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into ``out`` (u32[bitmask_words], bit ``t % 32`` of
        word ``t // 32`` set when token t is allowed)."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance past a sampled token; False when the grammar rejects it (the matcher is then
        in an error state for good)."""
        ...

    def accept_tokens(self, token_ids: list[int]) -> str | None:
        """Advance past a step's accepted tokens, in turn: "error" at the first one the grammar
        rejects, "stop" once it is complete (the tokens after that one not taken), else None.
        accept_token and is_terminated token by token, in one call: the engine's per-step
        path, once per constrained request."""
        ...

    def num_valid(self, token_ids: list[int]) -> int:
        """How many leading tokens of ``token_ids`` the grammar would accept in turn from the
        current state (the state does not change)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative drafts tried tentatively:
        structured/draft_checks.py)."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar is complete and cannot continue (or accepted EOS)."""
        ...

    def error(self) -> str:
        """Why the matcher failed ("" when it did not)."""
        ...


class BatchMaskFiller(Protocol):
    """Fills the mask rows of many matchers in one call (a library's own threads)."""

    bitmask_words: int  # u32 words of a row it fills (the backend's bitmask_words)

    def fill_rows(self, jobs: list[tuple[Matcher, int, list[int]]], out: np.ndarray) -> None:
        """For each ``(matcher, row, drafts)``: write into ``out[row + j]`` the matcher's mask
        after drafts[:j] (each u32[bitmask_words] as Matcher.fill_bitmask), for j = 0 up to
        len(drafts), stopping after the first row whose draft the grammar forbids and after
        the row that follows a draft ending the grammar (that row: EOS only); the rows it
        stops before are not written. Each matcher is left as it was. ``out``:
        u32[rows, bitmask_words], C-contiguous; the jobs' rows do not overlap."""
        ...


class CompiledGrammar(Protocol):
    """A compiled constraint, shared by every request that asks for the same one."""

    def new_matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start (cheap: a copy of a compiled one)."""
        ...


class StructuredOutputBackend(Protocol):
    """A grammar library over one tokenizer."""

    name: str
    bitmask_words: int  # u32 words of a mask row the library fills: ceil(its vocab / 32)

    def compile(self, kind: str, spec: str) -> CompiledGrammar:
        """Compile one constraint; ``kind`` is a StructuredOutputsParams kind and ``spec`` its
        canonical text (StructuredOutputsParams.cache_key).

        Raises:
            ValueError: the library's own message for a spec it cannot compile (a bad schema,
                an unsupported keyword, a grammar or regex that does not parse).
        """
        ...
