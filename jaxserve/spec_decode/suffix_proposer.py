"""SuffixProposer: suffix decoding (vLLM's "suffix" method, after Arctic Inference's
SuffixDecoding, arXiv 2411.04975), host side.

Two sources of guesses, each a suffix tree with frequency counts, and per request the one whose
guess scores higher (the expected number of accepted tokens):

    the request's own tokens (prompt and output): its longest suffix that occurred earlier in
        them, then the most frequent continuations. Computed on demand with numpy from the
        token buffer (own_proposal: the same counts a suffix tree of the tokens holds, in O(n)
        per step and no memory beyond the buffer);
    the outputs of the engine's requests (SuffixTree, appended as they are generated): what
        agents, tools and templated answers repeat across requests. The outputs of the
        ``max_cached_requests`` most recent finished requests stay in it.

The draft length adapts: at most max_spec_factor x the matched length, and it stops where the
running probability of the continuation falls below min_token_prob.

Cost: appending a token to the engine-wide tree visits only the open suffixes that occurred
elsewhere too (the tree is compressed: suffix_tree.py), and the own-token walk counts the few
continuations of a match in Python; the rest is the n-gram proposer's vectorised match
(docs/benchmarks.md measures both). The "auto" policy counts the proposer's time in the
throughput it measures, so it turns speculation off where this costs more than the drafts
gain.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from jaxserve.request import Request
from jaxserve.spec_decode.ngram_proposer import TokenBuffer, suffix_matches
from jaxserve.spec_decode.suffix_tree import Cursor, SuffixTree


@dataclass
class _Live:
    """A running request's state: its token buffer, and its output in the engine-wide tree
    (``cursor.tokens``: the tokens added to it)."""

    buffer: TokenBuffer = field(default_factory=TokenBuffer)
    cursor: Cursor = field(default_factory=Cursor)


class SuffixProposer:
    """Suffix-decoding proposer (module docstring); settings are SpeculativeConfig's."""

    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int,
        max_cached_requests: int,
        max_spec_factor: float,
        min_token_prob: float,
    ) -> None:
        self.k = num_speculative_tokens
        self.max_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.tree = SuffixTree(max_tree_depth)
        self._live: dict[str, _Live] = {}
        self._cached: OrderedDict[str, list[int]] = OrderedDict()  # finished, oldest first

    def propose(self, requests: Iterable[Request], k: int) -> dict[str, list[int]]:
        """Drafts (at most ``k`` each) for the given running decodes; those without a guess
        are left out. A request no longer given is done: its output stays in the tree among
        the most recent max_cached_requests."""
        requests = list(requests)
        given = {r.request_id for r in requests}
        for req_id in [r for r in self._live if r not in given]:
            self._retire(req_id)
        drafts = {}
        for req in requests:
            tokens = self._sync(req)
            own = own_proposal(tokens, self.max_depth, k, self.max_spec_factor,
                               self.min_token_prob)  # fmt: skip
            cursor = self._live[req.request_id].cursor  # its output's suffixes in the tree
            shared = self.tree.propose_at(cursor, k, self.max_spec_factor, self.min_token_prob)
            best = max(own, shared, key=lambda guess: guess[1])[0]
            if best:
                drafts[req.request_id] = best
        return drafts

    def _sync(self, req: Request) -> np.ndarray:
        """The request's tokens, its new output tokens added to the engine-wide tree."""
        live = self._live.get(req.request_id)
        if live is None:
            live = self._live[req.request_id] = _Live()
        tokens = live.buffer.sync(req.all_token_ids)
        new_output = tokens[req.num_prompt_tokens + len(live.cursor.tokens) :].tolist()
        if new_output:
            self.tree.extend(live.cursor, new_output)
        return tokens

    def _retire(self, req_id: str) -> None:
        output = self._live.pop(req_id).cursor.tokens
        if not output:
            return
        self._cached[req_id] = output
        while len(self._cached) > self.max_cached_requests:
            _, output = self._cached.popitem(last=False)
            self.tree.remove(output)


def own_proposal(
    tokens: np.ndarray, max_depth: int, k: int, max_spec_factor: float, min_prob: float
) -> tuple[list[int], float]:
    """(drafts, score) from the request's own tokens, SuffixTree.propose's walk on the tree of
    them: the longest suffix (at most max_depth - 1 tokens) that occurred earlier, then the
    most frequent next token among those occurrences (its share of them the step's
    probability), and so on, while the running probability stays >= min_prob, at most
    min(k, max_spec_factor * match length) tokens."""
    size = tokens.shape[0]
    if size < 2:
        return [], 0.0
    ends, length = suffix_matches(tokens, max_depth - 1)
    if not ends.size:
        return [], 0.0
    match = int(length.max())
    nxt = ends[length == match] + 1  # where each occurrence's continuation starts (< size)
    limit = min(k, int(max_spec_factor * match))
    out, prob, score = [], 1.0, 0.0
    while len(out) < limit and nxt.size:
        following = tokens[nxt]
        token, count = _most_frequent(following)
        prob *= count / nxt.size
        if prob < min_prob:
            break
        out.append(token)
        score += prob
        nxt = nxt[following == token] + 1
        nxt = nxt[nxt < size]
    return out, score


def _most_frequent(tokens: np.ndarray) -> tuple[int, int]:
    """The most frequent token of ``tokens`` (the smallest id among ties) and its count: in
    Python for the few occurrences a match usually has (a sort costs more there)."""
    if tokens.shape[0] > 32:
        values, counts = np.unique(tokens, return_counts=True)
        best = int(np.argmax(counts))
        return int(values[best]), int(counts[best])
    counts: dict[int, int] = {}
    for token in tokens.tolist():
        counts[token] = counts.get(token, 0) + 1
    top = max(counts.values())
    return min(t for t, n in counts.items() if n == top), top
