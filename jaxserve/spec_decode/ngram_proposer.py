"""NgramProposer: prompt-lookup drafts (vLLM's "ngram" method), host side, numpy.

For each request, the longest suffix of its tokens (prompt and outputs) of ``prompt_lookup_max``
down to ``prompt_lookup_min`` tokens that also occurs earlier proposes the k tokens that followed
its most recent earlier occurrence. Outputs that quote their input (summaries, code edits,
extraction) are where it hits.

Cost: each request's tokens live in a numpy buffer appended incrementally (only the tokens new
since the last call are copied), and a lookup is one vectorised pass comparing the buffer with
the last token, then at most ``prompt_lookup_max - 1`` gathers over the candidates it found:
O(n) per request per step, no Python loop over positions.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from jaxserve.request import Request


class TokenBuffer:
    """A request's tokens as a growable numpy array (amortised O(1) append)."""

    __slots__ = ("data", "size")

    def __init__(self) -> None:
        self.data = np.zeros(64, np.int32)
        self.size = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """Copy the tokens past ``size`` (tokens are only ever appended) and return a view of
        all of them."""
        n = len(token_ids)
        if n > self.data.shape[0]:
            grown = np.zeros(max(n, 2 * self.data.shape[0]), np.int32)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        if n > self.size:
            self.data[self.size : n] = token_ids[self.size : n]
        self.size = n
        return self.data[:n]


class NgramProposer:
    """Prompt-lookup proposer.

    Args:
        num_speculative_tokens: k, drafts proposed per request at most.
        prompt_lookup_min / prompt_lookup_max: the n-gram lengths tried (longest wins).
    """

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._buffers: dict[str, TokenBuffer] = {}

    def propose(self, requests: Iterable[Request], k: int) -> dict[str, list[int]]:
        """Drafts (at most ``k`` each) for the given requests; those without a match are left
        out. Forgets the buffers of requests not given (finished or no longer speculating)."""
        buffers, self._buffers = self._buffers, {}
        drafts = {}
        for req in requests:
            buf = buffers.get(req.request_id) or TokenBuffer()
            self._buffers[req.request_id] = buf
            found = propose_ngram(buf.sync(req.all_token_ids), self.min_n, self.max_n, k)
            if found:
                drafts[req.request_id] = found
        return drafts


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest suffix of ``tokens``
    of min_n..max_n tokens, at most k of them; [] when no such suffix occurs earlier.

    An occurrence ending at e (its last token tokens[e], e < len - 1) proposes
    tokens[e + 1 : e + 1 + k]; it may overlap the suffix itself (a repeated run of tokens
    proposes its own continuation).
    """
    if tokens.shape[0] < min_n + 1 or k < 1:
        return []
    ends, length = suffix_matches(tokens, max_n)
    if not ends.size:
        return []
    best = int(length.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent of the longest
    return tokens[end + 1 : end + 1 + k].tolist()


def suffix_matches(tokens: np.ndarray, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """The earlier occurrences of the last token (their positions e < len - 1, ascending) and
    how many tokens of the sequence's suffix each matches, ending at e (1..max_n): one
    vectorised comparison, then one [candidates, max_n - 1] gather of the tokens before them
    (the length: 1 + how many of those agree with the suffix before a first mismatch)."""
    size = tokens.shape[0]
    ends = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])  # occurrences of the last token
    n = min(max_n, size - 1)
    if n <= 1 or not ends.size:
        return ends, np.ones(ends.shape[0], np.int32)
    back = np.arange(1, n)  # j tokens before each end
    prev = ends[:, None] - back  # [C, n - 1]
    agree = (prev >= 0) & (tokens[np.maximum(prev, 0)] == tokens[size - 1 - back])
    length = 1 + np.cumprod(agree, axis=1, dtype=np.int32).sum(axis=1, dtype=np.int32)
    return ends, length
