"""The llguidance backend, the grammar compiler's cache and errors, bad words and the per-request
matcher state, on the demo model's tokenizer: no jax."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import numpy as np
import pytest
from tokenizers import AddedToken

from jaxserve import SamplingParams, StructuredOutputsParams
from jaxserve.checkpoints_tools.tiny_random import build_tiny_tokenizer
from jaxserve.structured.bad_words import banned_next_tokens, tokenize_bad_words
from jaxserve.structured.grammar_compiler import GrammarCompiler
from jaxserve.structured.llguidance_backend import LLGuidanceBackend
from jaxserve.structured.manager import StructuredOutputs
from jaxserve.structured.request_constraints import ALL_ALLOWED

EOS = 2
V = 1061  # a logits width past the tokenizer's 1024 ids and not a multiple of 32


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def structured(tokenizer):
    return StructuredOutputs(tokenizer, V, [EOS])


def _allowed(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def _walk(spec, tokenizer, rng, max_steps=200):
    """Sample uniformly among allowed tokens until the grammar completes: (text, ids)."""
    state = spec.new_state()
    ids: list[int] = []
    for _ in range(max_steps):
        row = np.full(state.num_words, ALL_ALLOWED, np.uint32)
        state.fill_mask(row, ids)
        allowed = _allowed(row)
        assert allowed.size and allowed.max() < 1024  # never the ids past the tokenizer
        token = int(rng.choice(allowed))
        ids.append(token)
        verdict = state.accept([token])
        if verdict == "stop" or token == EOS:
            break
        assert verdict is None
    return tokenizer.decode([t for t in ids if t != EOS]), ids


def test_random_walks_through_masks_give_valid_outputs(structured, tokenizer):
    rng = np.random.default_rng(0)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7},
                       "s": {"enum": ["x", "yy"]}},
        "required": ["n", "s"], "additionalProperties": False,
    }  # fmt: skip
    cases = [
        (StructuredOutputsParams(json=schema), lambda t: json.loads(t)["n"] in range(3, 8)),
        (StructuredOutputsParams(regex=r"[ab]{2}-[0-9]"),
         lambda t: re.fullmatch(r"[ab]{2}-[0-9]", t)),
        (StructuredOutputsParams(choice=["red", "green"]), lambda t: t in ("red", "green")),
        (StructuredOutputsParams(grammar='start: "<" D ">"\nD: /[0-9]{1,2}/'),
         lambda t: re.fullmatch(r"<[0-9]{1,2}>", t)),
        (StructuredOutputsParams(grammar='root ::= "go" [0-9]'),  # GBNF
         lambda t: re.fullmatch(r"go[0-9]", t)),
    ]  # fmt: skip
    for params, valid in cases:
        spec = structured.check(SamplingParams(structured_outputs=params))
        assert spec.num_words == (V + 31) // 32
        for _ in range(3):
            text, _ = _walk(spec, tokenizer, rng)
            assert valid(text), (params, text)


def test_json_object_takes_an_object_and_completes_at_its_end(structured, tokenizer):
    spec = structured.check(SamplingParams(structured_outputs={"json_object": True}))
    state = spec.new_state()
    ids = tokenizer.encode('{"a":[1,{"b":null}]}', add_special_tokens=False).ids
    assert state.accept(ids[:-1]) is None
    assert state.accept(ids[-1:]) == "stop"
    assert spec.new_state().accept(tokenizer.encode("[1]", add_special_tokens=False).ids) == "error"


@pytest.mark.parametrize(
    "params, match",
    [
        (StructuredOutputsParams(json={"type": "strin"}), r"structured_outputs\.json: .*strin"),
        (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}),
         r"structured_outputs\.json: Unimplemented keys: \[\"uniqueItems\"\]"),
        (StructuredOutputsParams(json={"$ref": "#/defs/x"}),
         r"structured_outputs\.json: .*/defs/x"),
        (StructuredOutputsParams(regex="[a-"), r"structured_outputs\.regex: .*regex"),
        (StructuredOutputsParams(grammar="start: undefined_rule"),
         r"structured_outputs\.grammar: .*undefined_rule"),
    ],
)  # fmt: skip
def test_what_does_not_compile_is_refused_by_field(structured, params, match):
    with pytest.raises(ValueError, match=match):
        structured.check(SamplingParams(structured_outputs=params))


def test_ids_outside_the_vocabulary_are_refused(tokenizer):
    checker = StructuredOutputs(tokenizer, V, [EOS])
    with pytest.raises(ValueError, match=r"allowed_token_ids: token id 1061 .*\[0, 1061\)"):
        checker.check(SamplingParams(allowed_token_ids=[5, V]))
    with pytest.raises(ValueError, match=r"logit_bias: token id 5000 .*\[0, 1061\)"):
        checker.check(SamplingParams(logit_bias={5000: 1.0}))
    assert checker.check(SamplingParams(logit_bias={5: 1.0}, allowed_token_ids=[5])) is None
    no_tokenizer = StructuredOutputs(None, V, [EOS])
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        no_tokenizer.check(SamplingParams(structured_outputs={"regex": "a"}))


def test_the_compiler_caches_by_kind_and_spec_and_compiles_in_threads(tokenizer):
    compiler = GrammarCompiler(LLGuidanceBackend(tokenizer, V, [EOS]), max_workers=2)
    a = StructuredOutputsParams(regex="[0-9]+")
    results = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(a)))
               for _ in range(4)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in results}) == 1 and compiler.num_compiled == 1
    compiler.compile(StructuredOutputsParams(regex="[0-9]+"))  # equal params: cached
    assert compiler.num_compiled == 1
    bad = StructuredOutputsParams(regex="(")
    for _ in range(2):  # a failure is cached too
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            compiler.compile(bad)
    assert compiler.num_compiled == 2
    compiler.shutdown()


def test_bad_words_ban_the_last_token_after_the_rest(tokenizer):
    sequences = tokenize_bad_words(["hello world", "the"], tokenizer)
    multi = tokenizer.encode("hello world", add_special_tokens=False).ids
    assert len(multi) > 1 and tuple(multi) in sequences
    single = tokenizer.encode("the", add_special_tokens=False).ids
    assert tuple(single) in sequences
    assert single[-1] in banned_next_tokens(sequences, [])  # a one-token word: always
    assert multi[-1] not in banned_next_tokens([tuple(multi)], [])
    assert banned_next_tokens([tuple(multi)], [7, *multi[:-1]]) == [multi[-1]]


def test_bad_words_and_a_grammar_share_one_mask(structured, tokenizer):
    (red,) = tokenizer.encode("red", add_special_tokens=False).ids
    params = SamplingParams(structured_outputs={"choice": ["red", "green"]}, bad_words=["red"])
    spec = structured.check(params)
    rng = np.random.default_rng(1)
    texts = set()
    for _ in range(8):
        text, ids = _walk(spec, tokenizer, rng)
        assert red not in ids  # "red" may still come spelled in other tokens, as in vLLM
        texts.add(text)
    assert texts <= {"red", "green"}


def _rows(state, outputs, drafts):
    rows = np.full((1 + len(drafts), state.num_words), ALL_ALLOWED, np.uint32)
    return rows, state.fill_masks(rows, outputs, drafts)


def test_drafts_are_tried_tentatively_and_cut_where_the_grammar_says(structured, tokenizer):
    choice = structured.check(SamplingParams(structured_outputs={"choice": ["yes", "no"]}))
    state = choice.new_state()
    yes = tokenizer.encode("yes", add_special_tokens=False).ids
    assert len(yes) == 2
    # Cut before the token that ends the grammar (it must be the step's last row), and at
    # the first token the grammar rejects; the matcher is left where it was.
    assert state.num_draft_tokens([], yes + [7]) == 1
    assert state.num_draft_tokens([], [999, *yes]) == 0
    rows, filled = _rows(state, [], yes)
    assert filled == 2 and set(_allowed(rows[1])) == {yes[1]}  # row j: after drafts 0..j-1
    assert (rows[2] == ALL_ALLOWED).all()  # past the grammar's end: never emitted
    assert state.run_length([*yes, EOS]) == 2 and state.run_length(yes[:1] + [5]) == 2
    assert state.accept(yes) == "stop"  # only accept advances it


def test_each_verification_row_masks_as_its_output_position_would(structured, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = structured.check(SamplingParams(structured_outputs={"json": schema}))
    rng = np.random.default_rng(3)
    _, ids = _walk(spec, tokenizer, rng)
    ids = [t for t in ids if t != EOS]
    assert len(ids) > 6
    state, pos = spec.new_state(), 0
    while pos < len(ids):  # steps verifying 3 drafts, every one right
        drafts = ids[pos : pos + 3]
        rows, filled = _rows(state, ids[:pos], drafts)
        for j in range(filled):  # the mask without speculation, one position at a time
            ref = spec.new_state()
            assert ref.accept(ids[: pos + j]) is None
            row = np.full(ref.num_words, ALL_ALLOWED, np.uint32)
            ref.fill_mask(row, ids[: pos + j])
            assert (row == rows[j]).all()
        n = min(filled, len(drafts))  # the last draft ends the grammar: its row is the last
        assert state.accept(ids[pos : pos + n]) == ("stop" if pos + n == len(ids) else None)
        pos += n
    # A draft the grammar forbids: the rows after it are left all-allowed (never emitted).
    rows, filled = _rows(spec.new_state(), [], [999, 5])
    assert filled == 1 and (rows[1:] == ALL_ALLOWED).all()


def test_bad_words_and_allowed_ids_cut_drafts_by_their_prefix(structured, tokenizer):
    seq = tokenizer.encode("France", add_special_tokens=False).ids
    (the,) = tokenizer.encode("the", add_special_tokens=False).ids
    params = SamplingParams(bad_words=["France"], allowed_token_ids=sorted({*seq, the}))
    state = structured.check(params).new_state()
    assert state.num_draft_tokens([], [the, seq[0], seq[1], the]) == 2  # the word's last token
    assert state.num_draft_tokens([seq[0]], [seq[1]]) == 0  # its prefix in the outputs
    assert state.num_draft_tokens([], [the, 5]) == 1  # 5 is not allowed
    rows, filled = _rows(state, [the], [seq[0], the])
    assert filled == 3
    assert seq[1] not in _allowed(rows[1]) and seq[1] in _allowed(rows[0])


def test_a_dead_end_after_a_draft_ends_the_request_only_when_its_row_is_reached():
    from types import SimpleNamespace

    from jaxserve.core.sched.output import SchedulerOutput
    from jaxserve.outputs import EngineCoreOutput
    from jaxserve.structured.bitmask import bitmask_words, token_bitmask
    from jaxserve.structured.request_constraints import ConstraintSpec
    from jaxserve.structured.step_masks import dead_ends_reached, with_token_masks

    a, b, words = 7, 9, bitmask_words(V)
    # Allowed: a and b; banned: b always, a after a. After the draft a nothing is left.
    spec = ConstraintSpec(None, ((a, a), (b,)), words, words, token_bitmask([a, b], V))
    # Scheduled: its 2 tokens in flight, their sample a placeholder (step_batch.py).
    req = SimpleNamespace(request_id="r", constraints=spec.new_state(), num_computed_tokens=4,
                          num_tokens=5, output_token_ids=[], eos_token_ids=[EOS],
                          num_inflight_tokens=2, num_output_placeholders=1,
                          is_finished=False)  # fmt: skip
    so = SchedulerOutput(num_scheduled_tokens={"r": 2}, scheduled_spec_decode_tokens={"r": [a]})
    so, dead_ends = with_token_masks(so, {"r": req}, {"r"})
    rows = so.token_masks["r"]
    assert rows.shape == (2, words) and dead_ends == {"r": 1}
    assert list(_allowed(rows[0])) == [a] and list(_allowed(rows[1])) == [EOS]
    emitted = [EngineCoreOutput("r", [b])], [EngineCoreOutput("r", [a, EOS])]
    assert dead_ends_reached(emitted[0], dead_ends) == []  # the draft was rejected
    assert dead_ends_reached(emitted[1], dead_ends) == ["r"]


class _MembershipOnly(frozenset):
    """A set of constrained ids that may be asked about one id, not walked."""

    def __iter__(self):
        raise AssertionError("walked every constrained request")


def test_a_steps_masks_look_at_its_scheduled_requests_not_every_constrained_one():
    """A step's constrained rows come from the requests it scheduled (at most max_num_seqs),
    in the scheduler's order: a queue of constrained requests costs each step nothing."""
    from types import SimpleNamespace

    from jaxserve.core.sched.output import SchedulerOutput
    from jaxserve.structured.bitmask import bitmask_words, token_bitmask
    from jaxserve.structured.draft_checks import cut_drafts
    from jaxserve.structured.request_constraints import ConstraintSpec
    from jaxserve.structured.step_masks import sampling_constrained

    words = bitmask_words(V)
    spec = ConstraintSpec(None, (), words, words, token_bitmask([7, 9], V))
    reqs = {rid: SimpleNamespace(request_id=rid, constraints=spec.new_state(),
                                 num_computed_tokens=4, num_tokens=5, num_inflight_tokens=1,
                                 num_output_placeholders=1, output_token_ids=[])
            for rid in ("q1", "b", "a", "q2", "c")}  # fmt: skip
    so = SchedulerOutput(num_scheduled_tokens={"b": 1, "c": 1, "a": 1})  # q1, q2: queued
    every = sampling_constrained(so, reqs, _MembershipOnly(reqs))
    assert [r.request_id for r in every] == ["b", "c", "a"]
    some = sampling_constrained(so, reqs, _MembershipOnly({"q1", "a", "b", "q2"}))
    assert [r.request_id for r in some] == ["b", "a"]
    # Drafts: only the proposals are looked at; one for a banned token is cut away.
    cut = cut_drafts({"a": [7, 8], "c": [8]}, reqs, _MembershipOnly({"a"}), lambda r: False)
    assert cut == {"a": [7], "c": [8]}


GET = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["n"], "additionalProperties": False}  # fmt: skip
PUT = {"type": "object", "properties": {"k": {"enum": ["a", "bb"]}, "v": {"type": "boolean"}},
       "required": ["k", "v"], "additionalProperties": False}  # fmt: skip
TAG = {
    "structures": [
        {"begin": "<fn=get>", "schema": GET, "end": "</fn>"},
        {"begin": "<fn=put>", "schema": PUT, "end": "</fn>"},
    ],
    "triggers": ["<fn="],
}


def test_structural_tag_text_is_free_until_a_trigger_then_the_tag_is_forced(structured, tokenizer):
    spec = structured.check(SamplingParams(structured_outputs={"structural_tag": TAG}))
    rng = np.random.default_rng(5)
    free = tokenizer.encode("Let me look: ", add_special_tokens=False).ids
    text_tokens = {t for t in range(3, 1024) if "\ufffd" not in tokenizer.decode([t])}
    assert len(text_tokens) > 800
    for _ in range(6):
        state = spec.new_state()
        assert state.accept(free) is None  # text before a trigger is free
        row = np.full(state.num_words, ALL_ALLOWED, np.uint32)
        state.fill_mask(row, free)
        assert text_tokens <= set(_allowed(row).tolist())  # any text (valid UTF-8) may come
        ids = list(free) + tokenizer.encode("<fn=", add_special_tokens=False).ids
        assert state.accept(ids[len(free) :]) is None
        for _ in range(60):  # inside the tag: walk uniformly among the allowed tokens
            row = np.full(state.num_words, ALL_ALLOWED, np.uint32)
            state.fill_mask(row, ids)
            token = int(rng.choice(_allowed(row)))
            ids.append(token)
            assert state.accept([token]) is None
            if tokenizer.decode(ids).endswith("</fn>"):
                break
        text = tokenizer.decode(ids)
        match = re.fullmatch(r"Let me look: <fn=(get|put)>(.*)</fn>", text)
        assert match, text
        jsonschema.validate(json.loads(match.group(2)), GET if match.group(1) == "get" else PUT)
        after = tokenizer.encode(" done", add_special_tokens=False).ids
        assert state.accept(after) is None  # free text again after the end


def test_structural_tag_trigger_that_is_a_special_token_is_matched_as_that_token(
    structured, tokenizer
):
    tag = {"structures": [{"begin": "<s>", "schema": GET, "end": ";"}], "triggers": ["<s>"]}
    spec = structured.check(SamplingParams(structured_outputs={"structural_tag": tag}))
    as_text = spec.new_state()  # "<s>" spelled in text tokens is plain text
    assert as_text.accept(tokenizer.encode("a < s > b", add_special_tokens=False).ids) is None
    state = spec.new_state()
    assert state.accept(tokenizer.encode("hi", add_special_tokens=False).ids + [1]) is None
    assert state.accept(tokenizer.encode("x", add_special_tokens=False).ids) == "error"
    # An added token that is not "special" (Qwen's <tool_call>) is one to llguidance too.
    qwen_like = build_tiny_tokenizer()
    qwen_like.add_tokens([AddedToken("<tool_call>", special=False)])
    call = qwen_like.token_to_id("<tool_call>")
    tag = {"structures": [{"begin": "<tool_call>", "schema": GET, "end": "</tool_call>"}],
           "triggers": ["<tool_call>"]}  # fmt: skip
    params = SamplingParams(structured_outputs={"structural_tag": tag})
    state = StructuredOutputs(qwen_like, V, [EOS]).check(params).new_state()
    ids = [*qwen_like.encode("hi", add_special_tokens=False).ids, call]
    assert state.accept(ids) is None
    body = qwen_like.encode('{"n":7}</tool_call>', add_special_tokens=False).ids
    assert state.accept(body) is None  # the tag, then free text again
    assert state.accept([call, *qwen_like.encode("x", add_special_tokens=False).ids]) == "error"
    # Triggers written like tokens that are partly special tokens, partly not: refused.
    mixed = {"structures": [{"begin": "<s>", "schema": GET, "end": ""},
                            {"begin": "<fn>", "schema": GET, "end": ""}],
             "triggers": ["<s>", "<fn>"]}  # fmt: skip
    with pytest.raises(ValueError, match=r"structured_outputs\.structural_tag: triggers \['<s>'\]"):
        structured.check(SamplingParams(structured_outputs={"structural_tag": mixed}))
    bad_schema = {"structures": [{"begin": "<a", "schema": {"type": "array", "uniqueItems": True},
                                  "end": ""}], "triggers": ["<a"]}  # fmt: skip
    with pytest.raises(ValueError, match=r"structural_tag: .*Unimplemented keys"):
        structured.check(SamplingParams(structured_outputs={"structural_tag": bad_schema}))
