"""SuffixTree: the truncated suffix tree of suffix decoding (vLLM's "suffix" method, after Arctic
Inference's SuffixDecoding, arXiv 2411.04975), host side, pure Python.

Every substring of at most ``max_depth`` tokens of the sequences it holds is a path from the root;
a node's count is how many times its path occurs. A proposal matches the longest suffix of a
request's tokens that occurred before and was followed by something, then walks down the most
frequent continuations while their estimated probability (the product of child / parent counts)
stays at or above ``min_token_prob``. Sequences are appended token by token (``Cursor`` keeps
the open suffixes), and a whole sequence can be removed again (the engine-wide tree forgets its
oldest requests).

Compressed: a substring that occurs once has no node of its own below the first one. Its path
is then a *leaf*: a node of count 1 that points at its one occurrence (a sequence and the
position it ends at), whose subtree is that sequence's next tokens, each of count 1, up to
max_depth; only substrings that occur at least twice are *full* nodes with their children
stored. Appending a token visits the full nodes among the sequence's open suffixes (those that
occurred elsewhere too: one or two on text that does not repeat, where the plain tree created
max_depth nodes per token) and creates one leaf at most per full node; a leaf that occurs a
second time becomes full, and its one child so far a leaf. Counts, and so every proposal, are
those of the plain tree (tests/spec_decode/suffix_tree_reference.py).

Invariants: every substring that occurs twice or more is a full node; a leaf's occurrence is
the one the pointer names; a cursor's open list holds every node (full or leaf) of a suffix of
its sequence shorter than max_depth, deepest first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class Cursor:
    """One sequence in the tree: its tokens so far, and the nodes of its suffixes shorter than
    the tree's depth (the deepest first)."""

    __slots__ = ("tokens", "open")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.open: list[_Node] = []


class _Node:
    """A substring: its length (depth) and count; a full node keeps its children, a leaf (count
    1) points at its one occurrence, ``seq.tokens[pos]`` its last token."""

    __slots__ = ("count", "depth", "children", "best", "seq", "pos")

    def __init__(self, depth: int, seq: Cursor | None = None, pos: int = 0) -> None:
        self.count = 1
        self.depth = depth
        self.children: dict[int, _Node] | None = None if seq is not None else {}
        self.best: int | None = None  # the most frequent child's token (None: to be found)
        self.seq = seq  # a leaf's sequence (None: a full node)
        self.pos = pos

    def most_frequent(self) -> tuple[int, _Node]:
        """A full node's child with the highest count: kept up to date as counts grow,
        searched again (once) after a removal; the first to reach the count wins a tie."""
        if self.best is None:
            self.best = max(self.children.items(), key=lambda item: item[1].count)[0]
        return self.best, self.children[self.best]


def _deepest_first(node: _Node) -> int:
    return -node.depth


class SuffixTree:
    """Counts of every substring of at most ``max_depth`` tokens of the sequences added."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(0)
        self.root.count = 0

    def extend(self, cursor: Cursor, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the sequence ``cursor`` follows: each new suffix (of every length
        up to max_depth) ending at each new token is counted once."""
        depth = self.max_depth
        seq = cursor.tokens
        for token in tokens:
            seq.append(token)
            pos = len(seq) - 1
            grown, woken = [], []
            for node in [*cursor.open, self.root]:
                if node.children is None:
                    continue  # a leaf at this sequence's end: its extension is implicit
                children = node.children
                child = children.get(token)
                if child is None:
                    child = children[token] = _Node(node.depth + 1, cursor, pos)
                else:
                    child.count += 1
                    if child.children is None:
                        self._make_full(child, woken)
                best = node.best
                if best is None or (best != token and child.count > children[best].count):
                    node.best = token if best is not None or len(children) == 1 else None
                if child.depth < depth:  # a suffix that reached max_depth tokens stops growing
                    grown.append(child)
            cursor.open = grown
            for leaf in woken:  # new leaves that end where their sequence ends: open there
                if leaf.pos == len(leaf.seq.tokens) - 1 and leaf not in leaf.seq.open:
                    leaf.seq.open.append(leaf)
                    leaf.seq.open.sort(key=_deepest_first)

    def _make_full(self, leaf: _Node, woken: list[_Node]) -> None:
        """A leaf seen a second time: it keeps its children from now on, the first one (the
        next token of its earlier occurrence, if any yet) a leaf there."""
        seq, pos = leaf.seq, leaf.pos
        leaf.seq, leaf.children = None, {}
        if leaf.depth < self.max_depth and pos + 1 < len(seq.tokens):
            token = seq.tokens[pos + 1]
            child = leaf.children[token] = _Node(leaf.depth + 1, seq, pos + 1)
            leaf.best = token
            if child.depth < self.max_depth:
                woken.append(child)

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back a whole sequence added with ``extend`` (its every substring's count), and
        drop the nodes no sequence reaches any more."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.max_depth]:
                if node.children is None:
                    break  # inside a leaf: its count fell with it
                child = node.children[token]
                child.count -= 1
                node.best = None  # counts fell: search again when asked
                if child.count == 0:
                    del node.children[token]  # and everything under it: counts only fall
                    break
                node = child

    def propose(
        self, context: Sequence[int], max_tokens: int, max_spec_factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """The most likely continuation of ``context`` and its score (the expected number of
        accepted tokens, the sum of the running probability products): its longest suffix
        (at most max_depth - 1 tokens) that occurred earlier and was followed by something;
        then at most min(max_tokens, max_spec_factor * match length) tokens, each the most
        frequent child, while the running probability stays >= min_prob. ([], 0.0) when
        nothing matches."""
        node, match = self._longest_match(context)
        return self._walk(node, match, max_tokens, max_spec_factor, min_prob)

    def propose_at(
        self, cursor: Cursor, max_tokens: int, max_spec_factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """``propose`` for the sequence ``cursor`` follows in this tree, in O(max_depth): its
        open suffixes are the candidate matches, the deepest with a continuation wins (a leaf
        there ends at this sequence's end: none)."""
        for node in cursor.open:
            if node.children:
                return self._walk(node, node.depth, max_tokens, max_spec_factor, min_prob)
        return [], 0.0

    def _walk(
        self, node: _Node | None, match: int, max_tokens: int, max_spec_factor: float,
        min_prob: float,
    ) -> tuple[list[int], float]:  # fmt: skip
        """The most frequent path below ``node`` (a match of ``match`` tokens), as propose;
        below a leaf, its occurrence's next tokens (each of probability 1 given the last)."""
        if node is None:
            return [], 0.0
        limit = min(max_tokens, int(max_spec_factor * match))
        out, prob, score = [], 1.0, 0.0
        while len(out) < limit and node.children:
            token, child = node.most_frequent()
            prob *= child.count / node.count
            if prob < min_prob:
                return out, score
            out.append(token)
            score += prob
            node = child
        if node.children is None and len(out) < limit:  # a leaf: the rest follows its sequence
            tokens = node.seq.tokens
            more = min(limit - len(out), self.max_depth - node.depth, len(tokens) - 1 - node.pos)
            out += tokens[node.pos + 1 : node.pos + 1 + more]
            for _ in range(more):  # added one by one: the plain tree's float sum exactly
                score += prob
        return out, score

    def _longest_match(self, context: Sequence[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``context`` with a continuation, and its length
        (inside a leaf: a leaf node of its own for that point of the occurrence)."""
        longest = min(len(context), self.max_depth - 1)
        for length in range(longest, 0, -1):
            node = self._find(context[len(context) - length :])
            if node is not None and self._continues(node):
                return node, length
        return None, 0

    def _find(self, path: Sequence[int]) -> _Node | None:
        """The node of ``path`` (a fresh leaf when it ends inside one), or None."""
        node = self.root
        for i, token in enumerate(path):
            if node.children is None:  # inside a leaf: follow its occurrence
                tokens, pos = node.seq.tokens, node.pos
                rest = list(path[i:])
                if list(tokens[pos + 1 : pos + 1 + len(rest)]) != rest:
                    return None
                return _Node(len(path), node.seq, pos + len(rest))
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def _continues(self, node: _Node) -> bool:
        """Whether ``node``'s substring was followed by something (within the depth)."""
        if node.children is not None:
            return bool(node.children)
        return node.depth < self.max_depth and node.pos + 1 < len(node.seq.tokens)
