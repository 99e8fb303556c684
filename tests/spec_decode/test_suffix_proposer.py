"""Suffix decoding's host side: the truncated suffix tree counts every substring (property test
against brute force), forgets a removed sequence exactly, proposes the most frequent
continuation with an adaptive length; the request's own-token proposal walks the same tree
(against a plain-Python reference); the proposer shares earlier requests' outputs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import suffix_tree_reference as reference
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.spec_decode.suffix_proposer import SuffixProposer, own_proposal
from jaxserve.spec_decode.suffix_tree import Cursor, SuffixTree

sequences = st.lists(st.integers(0, 3), min_size=1, max_size=30)


def _counts(tree) -> dict[tuple[int, ...], int]:
    """Every substring's count, a leaf's substrings (count 1: its occurrence's next tokens)
    spelt out."""
    out, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        if getattr(node, "children", None) is None:  # a leaf of the compressed tree
            tokens, end = node.seq.tokens, node.pos + 1
            for token in tokens[end : end + min(tree.max_depth - len(path), len(tokens) - end)]:
                path += (token,)
                out[path] = 1
            continue
        for token, child in node.children.items():
            out[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return out


def _brute(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                out[tuple(seq[i:j])] = out.get(tuple(seq[i:j]), 0) + 1
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 7), st.integers(1, 4), st.data())
def test_the_compressed_tree_counts_and_proposes_as_the_plain_one(depth, vocab, data):
    """Random interleavings of appends to several sequences, retirements and removals: the
    compressed tree's counts and proposals (from cursors and from contexts) are the plain
    tree's (suffix_tree_reference.py), tie-breaking and float scores included."""
    trees = SuffixTree(depth), reference.SuffixTree(depth)
    live: dict[int, tuple[Cursor, reference.Cursor, list[int]]] = {}
    retired: list[list[int]] = []
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["extend", "extend", "retire", "remove"]))
        if op == "extend" or not live:
            i = data.draw(st.integers(0, 4))
            cursor, ref_cursor, tokens = live.setdefault(i, (Cursor(), reference.Cursor(), []))
            new = data.draw(st.lists(st.integers(0, vocab - 1), max_size=3))
            trees[0].extend(cursor, new)
            trees[1].extend(ref_cursor, new)
            tokens += new
        elif op == "retire":
            retired.append(live.pop(data.draw(st.sampled_from(sorted(live))))[2])
        elif retired:
            gone = retired.pop(data.draw(st.integers(0, len(retired) - 1)))
            for tree in trees:
                tree.remove(gone)
        for cursor, ref_cursor, tokens in live.values():
            args = (data.draw(st.integers(1, 6)), data.draw(st.sampled_from([1.0, 2.0, 4.0])),
                    data.draw(st.sampled_from([0.0, 0.1, 0.4])))  # fmt: skip
            assert trees[0].propose_at(cursor, *args) == trees[1].propose_at(ref_cursor, *args)
            context = tokens[data.draw(st.integers(0, len(tokens))) :]
            assert trees[0].propose(context, *args) == trees[1].propose(context, *args)
    assert _counts(trees[0]) == _counts(trees[1])


@settings(max_examples=60, deadline=None)
@given(st.lists(sequences, min_size=1, max_size=4), st.integers(1, 6), st.data())
def test_counts_every_substring_and_forgets_a_removed_sequence(seqs, depth, data):
    tree = SuffixTree(depth)
    cursors = []
    for seq in seqs:
        cursors.append(cursor := Cursor())
        cut = data.draw(st.integers(0, len(seq)))  # appended in two parts, as a request grows
        tree.extend(cursor, seq[:cut])
        tree.extend(cursor, seq[cut:])
    assert _counts(tree) == _brute(seqs, depth)
    for seq, cursor in zip(seqs, cursors, strict=True):  # the O(depth) match, from the cursor
        assert tree.propose_at(cursor, 4, 2.0, 0.1) == tree.propose(seq, 4, 2.0, 0.1)
    gone = data.draw(st.integers(0, len(seqs) - 1))
    tree.remove(seqs[gone])
    assert _counts(tree) == _brute(seqs[:gone] + seqs[gone + 1 :], depth)


def test_proposes_the_most_frequent_continuation_while_likely_enough():
    tree = SuffixTree(8)
    for seq in ([1, 2, 3, 4, 7], [1, 2, 3, 5, 7], [1, 2, 3, 4, 8]):
        tree.extend(Cursor(), seq)
    # "1 2" matched (length 2): then 3 (prob 1), 4 (2/3), 7 or 8 (1/3 each: below 0.5).
    assert tree.propose([9, 1, 2], 8, 4.0, 0.5) == ([3, 4], 1.0 + 2 / 3)
    assert tree.propose([9, 1, 2], 8, 4.0, 0.2)[0] == [3, 4, 7]
    assert tree.propose([9, 1, 2], 8, 0.5, 0.2)[0] == [3]  # max_spec_factor x match length 2
    assert tree.propose([9, 1, 2], 1, 4.0, 0.2)[0] == [3]  # k
    assert tree.propose([6, 6], 8, 4.0, 0.1) == ([], 0.0)  # no match


def _own_reference(tokens, depth, k, factor, min_prob):
    size, best, starts = len(tokens), 0, []
    for m in range(min(depth - 1, size - 1), 0, -1):
        suffix = tokens[size - m :]
        found = [e + 1 for e in range(m - 1, size - 1) if tokens[e - m + 1 : e + 1] == suffix]
        if found:
            best, starts = m, found
            break
    out, prob, score = [], 1.0, 0.0
    while starts and len(out) < min(k, int(factor * best)):
        nxt = [tokens[s] for s in starts]
        values = sorted(set(nxt))
        counts = [nxt.count(v) for v in values]
        token = values[counts.index(max(counts))]
        prob *= max(counts) / len(nxt)
        if prob < min_prob:
            break
        out.append(token)
        score += prob
        starts = [s + 1 for s in starts if tokens[s] == token and s + 1 < size]
    return out, score


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),
    st.integers(2, 6),
    st.integers(1, 5),
    st.sampled_from([0.5, 1.0, 3.0]),
    st.sampled_from([0.0, 0.3]),
)
def test_own_proposal_walks_the_tree_of_the_requests_tokens(tokens, depth, k, factor, min_prob):
    got = own_proposal(np.asarray(tokens, np.int32), depth, k, factor, min_prob)
    want = _own_reference(tokens, depth, k, factor, min_prob)
    assert got[0] == want[0]
    assert abs(got[1] - want[1]) < 1e-9


def _request(req_id, prompt, output):
    return SimpleNamespace(request_id=req_id, all_token_ids=prompt + output,
                           num_prompt_tokens=len(prompt))  # fmt: skip


def test_outputs_of_earlier_requests_are_proposed_to_later_ones():
    proposer = SuffixProposer(4, 8, max_cached_requests=1, max_spec_factor=2.0,
                              min_token_prob=0.1)  # fmt: skip
    answer = [50, 51, 52, 53, 54, 55]
    proposer.propose([_request("a", [1, 2, 3], answer)], 4)
    proposer.propose([], 4)  # "a" finished: its output stays in the engine-wide tree
    # A different prompt whose output starts the same way: the tree knows the rest.
    assert proposer.propose([_request("b", [9, 9], [50, 51])], 4) == {"b": [52, 53, 54, 55]}
    proposer.propose([_request("c", [7], [60])], 4)
    proposer.propose([], 4)  # two finished, one kept: "a"'s output is forgotten
    assert proposer.propose([_request("d", [8, 8], [50, 51])], 4) == {}
