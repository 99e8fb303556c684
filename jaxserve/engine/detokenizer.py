"""Incremental detokenization and stop strings: the host-side text of one completion.

A completion's text grows one token (or a few) per engine step. Decoding all output tokens every
step would cost O(output length) per token, so IncrementalDetokenizer decodes only a short window
of trailing tokens, with the prefix/read offset technique of vLLM and Hugging Face TGI:

    all_ids:  prompt ... | ... output tokens ...
                     prefix_offset      read_offset        len(all_ids)
                         |<- prefix_text ->|<- new text ->|

``prefix_text = decode(all_ids[prefix_offset:read_offset])`` was emitted already; it is decoded
again only as context, so that decoders which look at neighbouring tokens (SentencePiece's leading
space, WordPiece's ``##`` pieces, bytes of one character split across byte-level BPE tokens) give
the same characters as a decode of the whole sequence. When the new text ends in U+FFFD, its last
character is (probably) incomplete: a multi-byte UTF-8 character whose remaining bytes come in the
next token. The offsets then stay put, and only the characters before that incomplete tail become
visible; once a token completes it, both offsets move forward. The window thus spans the tokens
since the last complete character: its length does not depend on the output length (it grows only
across a run of tokens that keeps ending inside an incomplete or invalid UTF-8 sequence).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from tokenizers import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first output token (vLLM uses the same count): enough
# for a SentencePiece leading space or a WordPiece "##" piece to see its left neighbour.
_INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text of one completion, decoded incrementally, with stop-string detection.

    Use: ``stop = detok.update(new_token_ids, finished=...)`` after every engine step, then
    ``detok.get_next_output_text(finished, delta)`` for what to hand the user.

    Invariants (while not finished):
      - ``output_text`` is a prefix of the text the finished completion will have, and never ends in
        U+FFFD (an incomplete character is held back until its last byte arrives).
      - If the decode of all output tokens does not end in U+FFFD, ``output_text`` equals it
        (before any stop-string truncation; with a byte-level tokenizer and a prompt that ends on a
        whole character, "the decode of all output tokens" is
        ``tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)``).
      - Once finished (``update(..., finished=True)`` or a stop string), ``output_text`` is final.

    Attributes:
        token_ids: every output token id passed to ``update``, in order (stop strings never remove
            tokens, only text).
        output_text: the visible text so far (stop string and anything after it cut off).
        stop_string: the stop string that finished the completion, or None.
        finished: True once the text is final.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        """Args:
            tokenizer: the model's tokenizer, or None for a model without one (the text then
                stays "").
            prompt_token_ids: the prompt; its last few tokens are decoded as left context.
            params: the request's sampling params (stop strings, skip_special_tokens,
                include_stop_str_in_output).

        Raises:
            ValueError: ``params`` has stop strings but there is no tokenizer to match them.
        """
        if tokenizer is None and params.stop_strings:
            raise ValueError(
                f"SamplingParams.stop needs a tokenizer to match stop strings, but the model has "
                f"none (stop={list(params.stop_strings)!r}); pass stop_token_ids instead"
            )
        self._tokenizer = tokenizer
        self._params = params
        self._skip_special_tokens = params.skip_special_tokens
        self.token_ids: list[int] = []
        self.output_text = ""
        self.stop_string: str | None = None
        self.finished = False
        # Streaming: characters held back while running, so that the beginning of a stop string is
        # not streamed before we know whether the rest follows (vLLM's stop buffer).
        longest_stop = max((len(s) for s in params.stop_strings), default=0)
        self._stop_buffer_length = (
            0 if params.include_stop_str_in_output else max(longest_stop - 1, 0)
        )
        self._num_streamed_chars = 0  # chars already returned by get_next_output_text(delta=True)
        # Decode window (see the module docstring). _all_ids = prompt context + output tokens.
        self._all_ids: list[int] = list(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:])
        self._read_offset = len(self._all_ids)
        self._prefix_offset = 0
        self._prefix_text = self._decode(self._all_ids) if tokenizer is not None else ""
        if self._prefix_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: no sound character boundary to diff against, so
            # the output is decoded on its own.
            self._prefix_offset = self._read_offset
            self._prefix_text = ""
        self._committed_text = ""  # output text of all_ids[:read_offset]

    def update(self, new_token_ids: list[int], *, finished: bool = False) -> str | None:
        """Append sampled tokens, extend ``output_text`` and look for stop strings.

        Args:
            new_token_ids: tokens sampled since the last call (may be empty).
            finished: True when the engine ends the completion with these tokens (EOS, stop token,
                max_tokens, abort): the held-back incomplete tail, if any, is then revealed as
                U+FFFD, exactly as a full decode shows it.

        Returns:
            The stop string that now ends the completion, or None. A match may span any number of
            tokens; among several stop strings, the one that completes first in the text wins
            (at equal end, the longest). The text is cut before the stop string, or after it with
            ``include_stop_str_in_output``.

        Raises:
            RuntimeError: the completion is already finished.
        """
        if self.finished:
            raise RuntimeError("IncrementalDetokenizer.update() called after the output finished")
        self.token_ids.extend(new_token_ids)
        if self._tokenizer is None:
            self.finished = finished
            return None
        self._all_ids.extend(new_token_ids)
        num_old_chars = len(self.output_text)
        pending_text = self._advance_window(reveal_tail=finished)  # may extend _committed_text
        self.output_text = self._committed_text + pending_text
        match = self._find_stop_string(num_old_chars)
        if match is not None:
            stop, start = match
            end = start + len(stop) if self._params.include_stop_str_in_output else start
            self.output_text = self.output_text[:end]
            self.stop_string = stop
            self.finished = True
            return stop
        self.finished = finished
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to hand the user now.

        Args:
            finished: the completion is over; nothing is held back. While running, the last
                ``max(len(stop)) - 1`` characters are held back (when stop strings are set and
                ``include_stop_str_in_output`` is off), since they may begin a stop string.
            delta: return only the text not returned by an earlier ``delta=True`` call; otherwise
                the whole text so far.

        Raises:
            RuntimeError: ``finished`` is True but ``update`` has not finished the completion (call
                ``update(..., finished=True)`` first, so that an incomplete tail is flushed).
        """
        if finished and not self.finished:
            raise RuntimeError(
                "get_next_output_text(finished=True) before update(..., finished=True): the "
                "detokenizer may still hold back an incomplete character"
            )
        length = len(self.output_text)
        if not finished:
            length = max(length - self._stop_buffer_length, 0)
        if not delta:
            return self.output_text[:length]
        # A stop string can shorten output_text below what was streamed only if it began in the
        # held-back buffer, which was never streamed; so the cursor never passes length.
        start = min(self._num_streamed_chars, length)
        self._num_streamed_chars = max(self._num_streamed_chars, length)
        return self.output_text[start:length]

    def _decode(self, token_ids: list[int]) -> str:
        assert self._tokenizer is not None
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _advance_window(self, *, reveal_tail: bool) -> str:
        """Decode the window and return the visible text after ``_committed_text``; move the
        offsets forward when the window ends on a whole character (or ``reveal_tail``)."""
        text = self._decode(self._all_ids[self._prefix_offset :])
        new_text = text[len(self._prefix_text) :]
        if new_text.endswith(_REPLACEMENT_CHAR) and not reveal_tail:
            # Characters before the trailing U+FFFD run are whole and final; the run may still
            # become a character when the next token brings the missing bytes.
            return new_text.rstrip(_REPLACEMENT_CHAR)
        self._committed_text += new_text
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._all_ids)
        self._prefix_text = self._decode(self._all_ids[self._prefix_offset : self._read_offset])
        return ""

    def _find_stop_string(self, num_old_chars: int) -> tuple[str, int] | None:
        """The stop string completing first in ``output_text`` among those that end in the chars
        added since ``num_old_chars`` (older matches would have finished the completion already),
        with its start index."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._params.stop_strings:
            # A match ending after num_old_chars starts after num_old_chars - len(stop).
            start = self.output_text.find(stop, max(num_old_chars - len(stop) + 1, 0))
            if start == -1:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[2], best[1])


def decode_logprob_tokens(tokenizer: Tokenizer, token_ids: list[int]) -> list[str]:
    """Each token decoded on its own, for ``Logprob.decoded_token``.

    Special tokens keep their text (a logprob entry names the token, even an EOS). A byte-level
    token holding part of a multi-byte character decodes to U+FFFD, as in vLLM.
    """
    return [tokenizer.decode([token_id], skip_special_tokens=False) for token_id in token_ids]
