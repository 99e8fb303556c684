"""PromptProcessor: a prompt in, checked token ids out, before anything is queued.

A prompt is text (tokenized here), token ids (checked against the vocabulary) or a dict of
either; a chat is rendered with its template in chat.py's sandbox first. Every refusal is a
TypeError or ValueError naming the field and the limit (docs/architecture.md, bad input);
text that cannot fit max_model_len is refused before it is tokenized (prompt_bound.py).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from jaxserve.engine.chat import missing_chat_template_error, render_chat
from jaxserve.engine.prompt_bound import check_text_length, max_token_chars

PromptType = str | list[int] | dict[str, Any]


class PromptProcessor:
    """Checks and tokenizes the prompts of one engine.

    Args:
        tokenizer_info: the checkpoint's tokenizer facts (its ``tokenizer``, None without one,
            chat template, BOS / EOS text).
        vocab_size: token ids must be in [0, vocab_size).
        max_model_len: the longest sequence, for refusing text that cannot fit.
        model_name: for messages.
    """

    def __init__(self, tokenizer_info: Any, vocab_size: int, max_model_len: int, model_name: str):
        self.tokenizer_info = tokenizer_info
        self.tokenizer = tokenizer_info.tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_name = model_name

    def process(
        self, prompt: PromptType, *, add_special_tokens: bool = True
    ) -> tuple[str | None, list[int]]:
        """Validate a prompt and tokenize it: (text or None, token ids). Allocates nothing.

        Args:
            add_special_tokens: let the tokenizer add its special tokens (BOS) to text; False
                for text that continues another (a chat rendering, a scored continuation).

        Raises:
            TypeError: not a str, a list of int, or a dict with "prompt" / "prompt_token_ids";
                token ids not in a list, tuple or numpy array.
            ValueError: empty, a token id outside [0, vocab_size), text that is not valid
                Unicode, text without a tokenizer.
        """
        text: str | None = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                token_ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
            elif "prompt" in prompt:
                text = prompt["prompt"]
                token_ids = None
            else:
                raise TypeError(
                    f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
                )
        elif isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            token_ids = prompt
        else:
            raise TypeError(
                f"prompt must be a str, a list of int or a dict, got {type(prompt).__name__}"
            )
        if token_ids is None:
            if not isinstance(text, str):
                raise TypeError(f"prompt text must be a str, got {type(text).__name__}")
            if not text:
                raise ValueError("prompt is empty (0 characters); need at least 1 token")
            _check_unicode(text)
            if self.tokenizer is None:
                raise ValueError(
                    f"model {self.model_name!r} has no tokenizer: pass prompt_token_ids"
                )
            check_text_length(text, self.max_model_len, self._max_token_chars)
            token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return text, self.check_token_ids(token_ids)

    @functools.cached_property
    def _max_token_chars(self) -> int:
        return max_token_chars(self.tokenizer)

    def check_token_ids(self, token_ids: Any) -> list[int]:
        # A sequence, not any iterable: a generator would be consumed by the checks below.
        if not isinstance(token_ids, (list, tuple, np.ndarray)):
            raise TypeError(
                f"prompt_token_ids must be a list of int, got {type(token_ids).__name__}"
            )
        if isinstance(token_ids, np.ndarray) and token_ids.ndim != 1:
            raise TypeError(f"prompt_token_ids must be 1-D, got shape {token_ids.shape}")
        bad_type = next(
            (t for t in token_ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))),
            None,
        )
        if bad_type is not None:
            raise TypeError(
                f"prompt_token_ids must be a list of int, got an element {bad_type!r} "
                f"({type(bad_type).__name__})"
            )
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("prompt is empty (0 tokens); need at least 1 token")
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        return ids

    def render_chat(
        self,
        messages: list[dict],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> dict[str, Any]:
        """One conversation rendered with the chat template (the tokenizer's, or
        ``chat_template``) as a prompt dict {"prompt", "prompt_token_ids"}. Allocates nothing.
        ``tools``: the JSON schemas of tools the template describes to the model.

        Raises:
            ValueError: no chat template, no tokenizer, or messages the template refuses.
            TypeError: messages that are not a list of dicts with str role and content.
        """
        info = self.tokenizer_info
        template = chat_template or info.chat_template
        if template is None:
            raise missing_chat_template_error(self.model_name)
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; the model has none")
        text = render_chat(
            messages,
            template,
            add_generation_prompt=add_generation_prompt,
            bos_token=info.bos_token or "",
            eos_token=info.eos_token or "",
            tools=tools,
        )
        _check_unicode(text)
        check_text_length(text, self.max_model_len, self._max_token_chars)
        # The template writes the special tokens itself: tokenize without adding them again.
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return {"prompt": text, "prompt_token_ids": ids}


def _check_unicode(text: str) -> None:
    """Text must be encodable as UTF-8 (a lone surrogate, e.g. from a bad decode, is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"prompt text is not valid Unicode: {e.reason} {text[e.start : e.end]!r} at "
            f"character {e.start}"
        ) from None
