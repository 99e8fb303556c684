"""The llguidance backend (https://github.com/guidance-ai/llguidance).

Chosen over xgrammar (imports torch) and outlines (its kernels need numba): llguidance is a Rust
library with a numpy bitmask API, no torch, grammars compiled lazily (the first masks are cheap
even for large schemas), JSON schema, regex and Lark grammars in one engine.

JSON is compact by default (no free whitespace between tokens, "x-guidance" in the schema may
say otherwise): a model is otherwise free to pad forever with whitespace, and a random test
model does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark
from tokenizers import Tokenizer

from jaxserve.structured.llguidance_tags import struct_tag_grammar

_JSON_DEFAULTS = {"whitespace_flexible": False}


class LLGuidanceBatchFiller:
    """backend.BatchMaskFiller over an llguidance.LLExecutor (a Rust thread pool): the rows of
    a step in one or two calls (one for the matchers without drafts, one for those with),
    with the GIL released."""

    def __init__(self, bitmask_words: int, num_threads: int) -> None:
        self.bitmask_words = bitmask_words
        self._executor = llguidance.LLExecutor(num_threads)

    def fill_rows(
        self, jobs: list[tuple[LLGuidanceMatcher, int, list[int]]], out: np.ndarray
    ) -> None:
        if out.dtype != np.uint32 or out.ndim != 2 or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"fill_rows: out must be contiguous u32[rows, words], got {out.dtype}")
        if out.shape[1] != self.bitmask_words:
            raise ValueError(
                f"fill_rows: out rows have {out.shape[1]} words, the tokenizer's "
                f"{self.bitmask_words}"
            )
        plain = [(m._matcher, row) for m, row, drafts in jobs if not drafts]
        drafted = [(m._matcher, row, list(drafts)) for m, row, drafts in jobs if drafts]
        ptr, row_bytes, num_rows = out.ctypes.data, out.shape[1] * 4, out.shape[0]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, ptr, row_bytes, num_rows)
        if drafted:
            if any(row + len(d) >= num_rows for _, row, d in drafted):
                raise ValueError(f"fill_rows: a job's draft rows pass out's {num_rows} rows")
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, ptr, row_bytes, num_rows
            )


class LLGuidanceMatcher:
    """backend.Matcher over an llguidance.LLMatcher."""

    def __init__(
        self, matcher: llguidance.LLMatcher, batch_filler: LLGuidanceBatchFiller | None = None
    ) -> None:
        self._matcher = matcher
        self.batch_filler = batch_filler

    def fill_bitmask(self, out: np.ndarray) -> None:
        if out.dtype != np.uint32 or out.ndim != 1 or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"fill_bitmask: out must be contiguous u32[words], got {out.dtype}")
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def accept_tokens(self, token_ids: list[int]) -> str | None:
        matcher = self._matcher
        for token in token_ids:
            if not matcher.consume_token(token):
                return "error"
            if matcher.is_stopped():
                return "stop"
        return None

    def num_valid(self, token_ids: list[int]) -> int:
        return self._matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens")

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""


class LLGuidanceGrammar:
    """backend.CompiledGrammar: a matcher at the start, copied for each request."""

    def __init__(
        self, template: llguidance.LLMatcher, batch_filler: LLGuidanceBatchFiller | None = None
    ) -> None:
        self._template = template
        self._batch_filler = batch_filler

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self._batch_filler)


class LLGuidanceBackend:
    """backend.StructuredOutputBackend over a Hugging Face ``tokenizers.Tokenizer``.

    Args:
        tokenizer: the engine's tokenizer.
        vocab_size: the model's logits width V (may exceed the tokenizer's vocabulary: the
            ids past it are never allowed).
        eos_token_ids: the ids that end generation; the grammar allows them once complete.
        fill_threads: threads of its matchers' batch fill (a step's grammar rows in one call:
            batch_fill.py); 0: none, the rows filled one by one on the caller's thread. The
            engine takes the execution plan's (plan.grammar_fill_threads).
    """

    name = "llguidance"

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        fill_threads: int = 0,
    ):
        n_vocab = max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        eos = sorted(eos_token_ids)
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=n_vocab, eos_token=eos or None
        )
        self.bitmask_words = (n_vocab + 31) // 32
        if fill_threads < 0:
            raise ValueError(f"LLGuidanceBackend: fill_threads must be >= 0, got {fill_threads}")
        self.batch_filler = None
        if fill_threads:
            self.batch_filler = LLGuidanceBatchFiller(self.bitmask_words, fill_threads)
        # llguidance's special tokens (every added token, "special" or not: Qwen's <tool_call>
        # too), by their text: structural-tag triggers that name one (llguidance_tags.py).
        added = tokenizer.get_added_tokens_decoder()
        self._special_tokens = frozenset(
            t.content for i, t in added.items() if self._tokenizer.is_special_token(i)
        )

    def compile(self, kind: str, spec: str) -> LLGuidanceGrammar:
        if kind == "structural_tag":
            grammar = struct_tag_grammar(spec, self._special_tokens, _JSON_DEFAULTS)
        else:
            grammar = _grammar(kind, spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tokenizer
        )
        if is_error:
            raise ValueError(messages[0].strip())
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error().strip())
        return LLGuidanceGrammar(matcher, self.batch_filler)


def _grammar(kind: str, spec: str) -> str:
    """llguidance's grammar text for a StructuredOutputsParams kind and its canonical spec."""
    from_schema = llguidance.LLMatcher.grammar_from_json_schema
    if kind == "json":
        try:
            return from_schema(spec, defaults=_JSON_DEFAULTS)
        except ValueError as e:  # not a JSON object
            raise ValueError(f"not a JSON schema object ({e})") from None
    if kind == "json_object":
        return from_schema({"type": "object"}, defaults=_JSON_DEFAULTS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if kind == "grammar":
        lark = gbnf_to_lark(spec) if "::=" in spec else spec
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise ValueError(f"unknown structured output kind {kind!r}")
