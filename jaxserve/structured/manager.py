"""StructuredOutputs: the engine's check of a request's constraints when it is queued.

Turns SamplingParams' structured_outputs, logit_bias, allowed_token_ids and bad_words into what
the engine needs (a ConstraintSpec: the compiled grammar and the bad words' token sequences;
logit_bias and allowed_token_ids travel to the runner in the params), refusing what it cannot
honour by name. The grammar library is loaded on the first request that needs it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from tokenizers import Tokenizer

from jaxserve.sampling_params import SamplingParams
from jaxserve.structured.bad_words import tokenize_bad_words
from jaxserve.structured.bitmask import token_bitmask
from jaxserve.structured.grammar_compiler import GrammarCompiler
from jaxserve.structured.request_constraints import ConstraintSpec


class StructuredOutputs:
    """Checks constraints against one model and tokenizer.

    Args:
        tokenizer: the engine's tokenizer; None refuses grammars and bad words (text-free
            checkpoints), not logit_bias or allowed_token_ids.
        vocab_size: the model's logits width V: ids must be below it.
        eos_token_ids: allowed by a grammar once it is complete.
        fill_threads: threads of the grammar library's batch mask fill; 0: row by row on the
            engine thread (the execution plan decides: plan.grammar_fill_threads).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        fill_threads: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.fill_threads = fill_threads
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_words = (vocab_size + 31) // 32
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # requests are checked from several threads (AsyncLLM)

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler, made (and the library loaded) on first use."""
        with self._lock:
            if self._compiler is None:
                from jaxserve.structured.llguidance_backend import LLGuidanceBackend

                tokenizer = self._need_tokenizer()
                try:
                    backend = LLGuidanceBackend(
                        tokenizer, self.vocab_size, self.eos_token_ids, self.fill_threads
                    )
                except Exception as e:  # the library's own error type for a tokenizer it refuses
                    raise ValueError(
                        "SamplingParams.structured_outputs: llguidance cannot use this model's "
                        f"tokenizer ({e})"
                    ) from None
                self._compiler = GrammarCompiler(backend)
            return self._compiler

    def check(self, params: SamplingParams) -> ConstraintSpec | None:
        """Everything about ``params``' constraints that needs the model: token ids within the
        vocabulary, the grammar compiled (cached), bad words tokenized. None when the request
        needs no per-step mask from the host (no grammar, no bad words).

        Raises:
            ValueError: naming the field, the value and the limit.
        """
        if not params.has_constraints:
            return None
        self._check_ids(params)
        grammar = None
        if params.structured_outputs is not None:
            self._need_tokenizer("structured_outputs")
            grammar = self.compiler.compile(params.structured_outputs)
        bad_words: tuple[tuple[int, ...], ...] = ()
        if params.bad_words:
            bad_words = tokenize_bad_words(params.bad_words, self._need_tokenizer("bad_words"))
        if grammar is None and not bad_words:
            return None
        backend_words = self.compiler.backend.bitmask_words if grammar else self.num_words
        allowed = None
        if params.allowed_token_ids is not None:
            allowed = token_bitmask(params.allowed_token_ids, self.vocab_size)
        return ConstraintSpec(grammar, bad_words, self.num_words, backend_words, allowed)

    def _check_ids(self, params: SamplingParams) -> None:
        v = self.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = [t for t in ids if t >= v]
            if bad:
                raise ValueError(
                    f"SamplingParams.{name}: token id {bad[0]} is outside the vocabulary [0, {v})"
                )

    def _need_tokenizer(self, name: str = "structured_outputs") -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(
                f"SamplingParams.{name} needs a tokenizer, and this model has none "
                "(no tokenizer.json)"
            )
        return self.tokenizer

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
