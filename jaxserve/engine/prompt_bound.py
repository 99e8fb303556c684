"""A prompt too long to fit, refused before it is tokenized.

Tokenizing is linear but slow (~1 s a megabyte of text), and a prompt of millions of tokens
need not be counted to the end to know it is over ``max_model_len``: no token covers more
characters of text than its vocabulary entry has (a byte-level BPE entry has one character a
byte, a SentencePiece entry ``▁word`` covers `` word``, a WordPiece ``##ing`` covers fewer).
So a text longer than ``max_model_len * longest entry`` characters has more than
``max_model_len`` tokens. Normalizers can shrink text before it is split (Unicode composition
joins up to a few code points into one), hence the slack factor: the bound only ever refuses a
prompt that could not fit. A tokenizer whose unknown token can stand for a whole word or a run
of characters has no such bound, and its prompts are tokenized to the end.
"""

from __future__ import annotations

import json
from typing import Any

NORMALIZER_SLACK = 4  # characters a normalizer may fold into one, at most


def max_token_chars(tokenizer: Any) -> int | None:
    """The longest vocabulary entry of ``tokenizer`` (a ``tokenizers.Tokenizer``), in
    characters: no token of a tokenized text covers more of it than this (module docstring).
    None when one token can cover text of any length: an unknown token that stands for a whole
    word (WordPiece, WordLevel) or a run of unknown characters (fused, without byte fallback)."""
    if _unknown_token_covers_runs(json.loads(tokenizer.to_str()).get("model") or {}):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max((len(piece) for piece in vocab), default=1)


def _unknown_token_covers_runs(model: dict[str, Any]) -> bool:
    if model.get("byte_fallback"):  # unknown characters become byte tokens, one a byte
        return False
    kind = model.get("type")
    if kind == "BPE":
        return bool(model.get("fuse_unk")) and model.get("unk_token") is not None
    if kind == "Unigram":  # tokenizers' Unigram always fuses unknown characters
        return model.get("unk_id") is not None
    return True  # WordPiece and WordLevel: [UNK] stands for a whole word; unknown models too


def check_text_length(text: str, max_model_len: int, token_chars: int | None) -> None:
    """Raise when ``text`` certainly tokenizes to more than ``max_model_len`` tokens
    (never when ``token_chars`` is None: max_token_chars found no bound).

    Raises:
        ValueError: naming the length, the bound and max_model_len.
    """
    if token_chars is None:
        return
    bound = max_model_len * max(1, token_chars) * NORMALIZER_SLACK
    if len(text) > bound:
        raise ValueError(
            f"prompt of {len(text)} characters is longer than any prompt of max_model_len="
            f"{max_model_len} tokens can be ({bound} characters: {max_model_len} tokens x "
            f"{token_chars} characters for the tokenizer's longest token x {NORMALIZER_SLACK}); "
            f"it was refused before tokenizing"
        )
