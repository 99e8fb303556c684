"""Structured outputs, logit_bias, allowed_token_ids and bad_words end to end on the demo
model (random weights: only the mask keeps its outputs valid), greedy and temperature 1.0,
with n > 1 and preemption."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams

# The configuration of tests/engine/test_llm.py's module engine: its compiled steps are shared
# through the session's compilation cache.
CONFIG = dict(
    num_kv_blocks=64,
    block_size=8,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    max_model_len=128,
    warmup=False,
)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["a", "bb", "ccc"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "city": {"type": "string", "maxLength": 6},
            },
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
SCORE = {  # an unbounded fraction: sampled only (greedy repeats a digit past max_tokens)
    "type": "object",
    "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "ok": {"type": "boolean"},
        "note": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": -5, "maximum": 5}]},
    },
    "required": ["score", "ok"],
    "additionalProperties": False,
}
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
          "minItems": 2, "maxItems": 4}  # fmt: skip
CODE = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", 3, None]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"},
        "extra": {"type": "boolean"},
    },
    "required": ["kind", "code"],
    "additionalProperties": False,
}
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random-llama", **CONFIG)


def _generate(llm, prompts, params):
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


def test_json_schemas_validate_greedy_and_sampled(llm):
    cases = [(s, GREEDY) for s in (PERSON, DIGITS, CODE)]
    cases += [(s, SAMPLED) for s in (PERSON, SCORE, DIGITS, CODE)]
    params = [
        SamplingParams(max_tokens=100, n=2 if kw is SAMPLED else 1,
                       structured_outputs=StructuredOutputsParams(json=s), **kw)
        for s, kw in cases
    ]  # fmt: skip
    params.append(
        SamplingParams(max_tokens=60, structured_outputs={"json_object": True}, **SAMPLED)
    )
    outs = _generate(llm, ["Hi", "Describe a person:"] * 4, params)
    for (schema, _), completions in zip(cases, outs, strict=False):
        for c in completions:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)
    assert outs[-1][0].finish_reason == "stop" and isinstance(json.loads(outs[-1][0].text), dict)
    # Keys come in the schema's order.
    assert list(json.loads(outs[0][0].text)) == list(PERSON["properties"])


def test_regex_choice_and_lark_grammar(llm):
    regex = r"[a-c]{3}-[0-9]{2}"
    grammar = 'start: pair ("," pair)?\npair: KEY "=" VAL\nKEY: /[a-z]{1,3}/\nVAL: /[0-9]{1,2}/'
    choices = ["yes", "no", "maybe so"]
    params = []
    for kw in (GREEDY, SAMPLED):
        params += [
            SamplingParams(max_tokens=30, structured_outputs={"regex": regex}, **kw),
            SamplingParams(max_tokens=30, n=3, structured_outputs={"choice": choices}, **kw),
            SamplingParams(max_tokens=30, structured_outputs={"grammar": grammar}, **kw),
        ]
    outs = _generate(llm, ["Pick one"] * len(params), params)
    for i in (0, 3):
        assert re.fullmatch(regex, outs[i][0].text)
        assert all(c.text in choices and c.finish_reason == "stop" for c in outs[i + 1])
        assert re.fullmatch(r"[a-z]{1,3}=[0-9]{1,2}(,[a-z]{1,3}=[0-9]{1,2})?", outs[i + 2][0].text)


def test_logit_bias_forces_and_bans(llm):
    plain = _generate(llm, ["Once"], SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY))
    favourite = plain[0][0].token_ids[0]
    forced, banned = _generate(
        llm,
        ["Once", "Once"],
        [
            SamplingParams(max_tokens=8, logit_bias={500: 100.0}, **SAMPLED),
            SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={favourite: -100}, **GREEDY),
        ],
    )
    assert forced[0].token_ids == [500] * 8
    assert favourite not in banned[0].token_ids


def test_allowed_token_ids_and_bad_words(llm):
    tokenizer = llm.get_tokenizer()
    word = "France"  # two tokens in the demo tokenizer
    seq = tokenizer.encode(word, add_special_tokens=False).ids
    single = tokenizer.encode("the", add_special_tokens=False).ids
    assert len(seq) == 2 and len(single) == 1
    allowed = sorted({*seq, *single})
    # Only the bad words' tokens: without the ban they come often.
    base = dict(max_tokens=40, ignore_eos=True, allowed_token_ids=allowed, temperature=1.0, n=3)
    free, constrained = _generate(
        llm,
        ["Say"] * 2,
        [SamplingParams(seed=1, **base), SamplingParams(seed=1, bad_words=[word, "the"], **base)],
    )

    def contains(ids, sub):
        return any(ids[i : i + len(sub)] == sub for i in range(len(ids) - len(sub) + 1))

    assert all(set(c.token_ids) <= set(allowed) for c in free)
    assert any(contains(c.token_ids, seq) for c in free)
    for c in constrained:
        ids = c.token_ids
        assert set(ids) <= set(allowed) and len(ids) == 40
        assert not contains(ids, seq) and single[0] not in ids


def test_constraints_that_leave_no_token_end_the_request(llm):
    (the,) = llm.get_tokenizer().encode("the", add_special_tokens=False).ids
    eos = sorted(llm.engine.info.eos_token_ids)
    dead_ends = [
        SamplingParams(allowed_token_ids=[the], bad_words=["the"], **SAMPLED),
        SamplingParams(allowed_token_ids=[5], structured_outputs={"choice": ["the"]}, **GREEDY),
    ]
    for (c,) in _generate(llm, ["x", "y"], dead_ends):
        assert c.finish_reason == "abort" and c.token_ids == eos[:1]  # EOS, never a token 0
    assert not llm.engine.has_unfinished_requests()


def test_preemption_and_chunking_keep_each_matcher_in_step(llm):
    before = llm.get_stats()["num_preemptions"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(40)] for _ in range(8)]
    params = SamplingParams(max_tokens=86, structured_outputs={"json": PERSON}, **SAMPLED)
    outs = _generate(llm, prompts, params)
    assert llm.get_stats()["num_preemptions"] > before  # 8 x ~120 tokens in 63 x 8 slots
    for (c,) in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)


FLAG = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


def _tagged(text: str, trigger: str, begin: str, end: str) -> tuple[str, list]:
    """(the text before the first trigger, the JSON value of every tag); only the last tag
    may be cut short (by max_tokens)."""
    decoder, values = json.JSONDecoder(), []
    pos = text.find(trigger)
    free = text if pos < 0 else text[:pos]
    while pos >= 0:
        body = pos + len(begin)
        if not text.startswith(begin, pos):
            assert begin.startswith(text[pos:]), text  # cut inside the begin
            break
        try:
            value, stop = decoder.raw_decode(text, body)
        except json.JSONDecodeError:
            assert trigger not in text[body:], text  # cut inside the JSON
            break
        values.append(value)
        assert text.startswith(end, stop) or end.startswith(text[stop:]), text
        pos = text.find(trigger, stop + len(end))
    return free, values


def test_structural_tag_free_text_until_a_trigger_then_json_under_its_schema(llm):
    (trigger,) = llm.get_tokenizer().encode("all", add_special_tokens=False).ids
    tag = {"structures": [{"begin": "all=", "schema": FLAG, "end": ";"}], "triggers": ["all"]}
    # A bias on the trigger's token: the random model writes some text, then the trigger.
    base = dict(max_tokens=40, ignore_eos=True, logit_bias={trigger: 5.0})
    constrained = dict(base, structured_outputs={"structural_tag": tag})
    plain, greedy, sampled = _generate(
        llm,
        ["JSON:"] * 3,
        [
            SamplingParams(**base, **GREEDY),
            SamplingParams(**constrained, **GREEDY),
            SamplingParams(n=2, **constrained, **SAMPLED),
        ],
    )
    for c in [*greedy, *sampled]:
        free, values = _tagged(c.text, "all", "all=", ";")
        assert values, c.text
        for value in values:
            jsonschema.validate(value, FLAG)
    # Before the trigger nothing is masked: the same tokens as without the constraint.
    free, _ = _tagged(greedy[0].text, "all", "all=", ";")
    assert free and plain[0].text.startswith(free + "all")


@pytest.mark.parametrize(
    "params, match",
    [
        (SamplingParams(structured_outputs={"json": {"type": "array", "uniqueItems": True}}),
         r"prompts\[1\]: SamplingParams.structured_outputs.json: Unimplemented keys"),
        (SamplingParams(structured_outputs={"grammar": "start: nope"}),
         r"SamplingParams.structured_outputs.grammar: .*nope"),
        (SamplingParams(allowed_token_ids=[10**6]), r"allowed_token_ids: token id 1000000"),
    ],
)  # fmt: skip
def test_bad_constraints_fail_before_anything_is_queued(llm, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["ok", "bad"], [SamplingParams(), params], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_usable_kv_blocks"]


def test_the_engine_forgets_each_constrained_request_as_it_ends_while_others_run(llm, monkeypatch):
    """The engine core's set of constrained ids drops a request when it finishes or is
    aborted (the step's finished ids), not by a walk over the queue each step: with an
    unconstrained request still running, the set empties as the constrained ones end."""

    class NoSweep(set):
        def intersection_update(self, *others):
            raise AssertionError("swept the constrained ids against every request")

    engine = llm.engine
    monkeypatch.setattr(engine.core.constrained, "ids", NoSweep(engine.core.constrained.ids))
    engine.add_request("long", "Hi", SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY))
    for rid, so in (("label", {"choice": ["yes", "no"]}), ("gone", {"json": PERSON})):
        engine.add_request(rid, "Hi", SamplingParams(max_tokens=100, structured_outputs=so))
    engine.step()
    engine.abort_request("gone")
    ended: set[str] = set()
    for _ in range(20):
        ended |= {o.request_id for o in engine.step() if o.finished}
        if "label" in ended:
            break
    for _ in range(3):  # a later schedule hands the ended ids over (async: one step late)
        if not engine.core.constrained:
            break
        ended |= {o.request_id for o in engine.step() if o.finished}
    assert "label" in ended and "long" not in ended and engine.has_unfinished_requests()
    assert not engine.core.constrained
    while engine.has_unfinished_requests():
        engine.step()
