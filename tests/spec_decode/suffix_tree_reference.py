"""The plain truncated suffix tree (one Python node per substring of at most max_depth tokens)
that jaxserve/spec_decode/suffix_tree.py replaced: the reference its compressed tree is checked
against (test_suffix_proposer.py: same counts, same proposals, through extends and removals).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class _Node:
    __slots__ = ("count", "children", "best")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}
        self.best: int | None = None  # the most frequent child's token (None: to be found)

    def most_frequent(self) -> tuple[int, _Node]:
        """The child with the highest count: kept up to date as counts grow, searched again
        (once) after a removal."""
        if self.best is None:
            self.best = max(self.children.items(), key=lambda item: item[1].count)[0]
        return self.best, self.children[self.best]


class Cursor:
    """Where appending to one sequence continues: the nodes of its suffixes shorter than the
    tree's depth (the deepest first)."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open: list[_Node] = []


class SuffixTree:
    """Counts of every substring of at most ``max_depth`` tokens of the sequences added."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()

    def extend(self, cursor: Cursor, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the sequence ``cursor`` follows: each new suffix (of every length
        up to max_depth) ending at each new token is counted once."""
        depth = self.max_depth
        for token in tokens:
            grown = []
            for node in [*cursor.open, self.root]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                best = node.best
                if best is None or (best != token and child.count > node.children[best].count):
                    node.best = token if best is not None or len(node.children) == 1 else None
                grown.append(child)
            # A suffix that reached max_depth tokens stops growing.
            cursor.open = grown[-(depth - 1) :] if depth > 1 else []

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back a whole sequence added with ``extend`` (its every substring's count), and
        drop the nodes no sequence reaches any more."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.max_depth]:
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
        open suffixes are the candidate matches, the deepest with a continuation wins."""
        depth = len(cursor.open)
        for i, node in enumerate(cursor.open):  # deepest first: lengths depth, depth - 1, ...
            if node.children:
                return self._walk(node, depth - i, max_tokens, max_spec_factor, min_prob)
        return [], 0.0

    def _walk(
        self, node: _Node | None, match: int, max_tokens: int, max_spec_factor: float,
        min_prob: float,
    ) -> tuple[list[int], float]:  # fmt: skip
        """The most frequent path below ``node`` (a match of ``match`` tokens), as propose."""
        if node is None:
            return [], 0.0
        limit = min(max_tokens, int(max_spec_factor * match))
        out, prob, score = [], 1.0, 0.0
        while len(out) < limit and node.children:
            token, child = node.most_frequent()
            prob *= child.count / node.count
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            node = child
        return out, score

    def _longest_match(self, context: Sequence[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``context`` with a continuation, and its length."""
        longest = min(len(context), self.max_depth - 1)
        for length in range(longest, 0, -1):
            node = self.root
            for token in context[len(context) - length :]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None, 0
