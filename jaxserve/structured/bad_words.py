"""bad_words as vLLM applies them: each word becomes the token sequences it is written as (at
the start of the text, and after a space when that is a different first token of the same
length); the last token of a sequence is banned whenever the output so far ends with the rest
of it. A word that the model spells another way (other tokens) is not caught, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer


def tokenize_bad_words(words: Sequence[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """The token sequences to ban for ``words`` (vLLM's SamplingParams.update_from_tokenizer)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False).ids)
        sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return tuple(s for s in sequences if s)


def banned_next_tokens(
    sequences: Sequence[tuple[int, ...]], output_token_ids: Sequence[int]
) -> list[int]:
    """The tokens that would complete a bad word after ``output_token_ids``."""
    banned = []
    num_outputs = len(output_token_ids)
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix > num_outputs:
            continue
        if prefix == 0 or list(output_token_ids[num_outputs - prefix :]) == list(seq[:prefix]):
            banned.append(seq[-1])
    return banned
