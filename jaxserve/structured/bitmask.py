"""Packed token bitmasks, host side: u32 words, bit ``t % 32`` of word ``t // 32`` set when
token t is allowed (llguidance's layout, and what the runner's sampler reads)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

ALL_ALLOWED = np.uint32(0xFFFFFFFF)


def bitmask_words(vocab_size: int) -> int:
    """u32 words of a bitmask row over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def token_bitmask(token_ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """u32[bitmask_words(vocab_size)] with exactly the bits of ``token_ids`` set."""
    ids = np.fromiter(token_ids, np.int64)
    bits = np.zeros(32 * bitmask_words(vocab_size), np.uint8)
    bits[ids] = 1
    return np.packbits(bits, bitorder="little").view(np.uint32)


def set_bits(row: np.ndarray, token_ids: Iterable[int]) -> None:
    """Allow ``token_ids`` in ``row`` (in place); those past the row are left out."""
    for token in token_ids:
        if token < 32 * row.shape[0]:
            row[token >> 5] |= np.uint32(1 << (token & 31))


def has_bit(row: np.ndarray, token: int) -> bool:
    """Whether ``row`` allows ``token`` (a token past the row is never allowed)."""
    return 0 <= token < 32 * row.shape[0] and bool((int(row[token >> 5]) >> (token & 31)) & 1)


def clear_bit(row: np.ndarray, token: int) -> None:
    """Disallow ``token`` in ``row`` (in place); a token past the row is never allowed anyway."""
    if token < 32 * row.shape[0]:
        row[token >> 5] &= ~np.uint32(1 << (token & 31))
