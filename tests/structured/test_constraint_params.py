"""SamplingParams' constraint fields (jaxserve/sampling_constraints.py): host-only checks, each
refusal naming the field, the value and the cap."""

from __future__ import annotations

import json
import math

import pytest

from jaxserve import SamplingParams, StructuredOutputsParams
from jaxserve.sampling_constraints import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS_TOKENS,
)


def test_each_kind_is_accepted_and_keyed():
    kinds = {
        "json": StructuredOutputsParams(json={"type": "object"}),
        "regex": StructuredOutputsParams(regex="[a-z]+"),
        "choice": StructuredOutputsParams(choice=["yes", "no"]),
        "grammar": StructuredOutputsParams(grammar='start: "a"'),
        "json_object": StructuredOutputsParams(json_object=True),
        "structural_tag": StructuredOutputsParams(
            structural_tag={
                "structures": [{"begin": "<a", "schema": {}, "end": ""}],
                "triggers": ["<a"],
            }
        ),
    }
    for kind, params in kinds.items():
        assert params.kind == kind
        assert params.cache_key()[0] == kind
    # A schema keeps its key order (the order of the output's keys), as text or as a dict.
    a = StructuredOutputsParams(json={"b": 1, "a": 2}).cache_key()
    assert a == ("json", '{"b": 1, "a": 2}')
    sp = SamplingParams(structured_outputs={"choice": ["x"]})  # a dict is accepted (JSON bodies)
    assert sp.structured_outputs == StructuredOutputsParams(choice=["x"])
    assert sp.has_constraints and not SamplingParams().has_constraints


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({}, ValueError, "exactly one of"),
        ({"json": {"type": "object"}, "regex": "a"}, ValueError, r"exactly one.*'json', 'regex'"),
        ({"json": "{not json"}, ValueError, "StructuredOutputsParams.json: not valid JSON"),
        ({"json": [1, 2]}, TypeError, "StructuredOutputsParams.json must be a JSON schema"),
        ({"regex": 5}, TypeError, "StructuredOutputsParams.regex must be a str"),
        ({"grammar": ""}, ValueError, "StructuredOutputsParams.grammar must not be empty"),
        ({"choice": []}, ValueError, "StructuredOutputsParams.choice must be non-empty"),
        ({"choice": ["a", 1]}, TypeError, "StructuredOutputsParams.choice must be a list of str"),
        ({"choice": ["a"] * 1025}, ValueError, "MAX_CHOICES=1024"),
        ({"json_object": "yes"}, TypeError, "json_object must be True"),
    ],
)
def test_structured_outputs_params_refusals(kwargs, error, match):
    with pytest.raises(error, match=match):
        StructuredOutputsParams(**kwargs)


def test_an_unknown_structured_outputs_key_is_named():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['whitespace_pattern'\]"):
        SamplingParams(structured_outputs={"whitespace_pattern": "x"})


SCHEMA = {"type": "object", "properties": {"b": {}, "a": {}}}
TAG = {"structures": [{"begin": "<f=x>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f="]}


def test_a_structural_tag_is_kept_as_canonical_text_from_a_dict_or_json():
    a = StructuredOutputsParams(structural_tag={"type": "structural_tag", **TAG})
    b = StructuredOutputsParams(structural_tag=json.dumps(TAG))
    assert a.kind == "structural_tag" and a == b and a.cache_key() == b.cache_key()
    assert json.loads(a.structural_tag) == TAG  # "type" dropped, the schema's key order kept
    assert list(json.loads(a.structural_tag)["structures"][0]["schema"]["properties"]) == ["b", "a"]
    sp = SamplingParams(structured_outputs={"structural_tag": TAG})
    assert sp.structured_outputs == a


def _tag(**structure):
    return {"structures": [{"begin": "<f=x>", "schema": SCHEMA, "end": "", **structure}],
            "triggers": ["<f="]}  # fmt: skip


@pytest.mark.parametrize(
    "tag, error, match",
    [
        ("{nope", ValueError, r": not valid JSON"),
        ([TAG], TypeError, r" must be an object"),
        ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, ValueError,
         r"\.format: xgrammar's"),
        ({**TAG, "extra": 1}, ValueError, r": unknown field\(s\) \['extra'\]"),
        ({**TAG, "type": "json"}, ValueError, r"\.type must be 'structural_tag'"),
        ({**TAG, "structures": []}, TypeError, r"\.structures must be a non-empty"),
        ({**TAG, "triggers": [""]}, ValueError, r"\.triggers\[0\] must be"),
        ({**TAG, "triggers": ["<"] * 129}, ValueError, r"\.triggers: 129 items exceed the cap of"),
        (_tag(begin="x"), ValueError, r"\.structures\[0\]\.begin 'x' starts with none of"),
        (_tag(begin=""), ValueError, r"\.structures\[0\]\.begin must be a non-empty str"),
        (_tag(schema="{}"), TypeError, r"\.structures\[0\]\.schema must be a JSON schema"),
        (_tag(end=None), TypeError, r"\.structures\[0\]\.end must be a str"),
        (_tag(stop="x"), ValueError, r"\.structures\[0\]: unknown field\(s\) \['stop'\]"),
        (_tag(schema={"x": {1, 2}}), TypeError, r": not JSON-serialisable"),
    ],
)  # fmt: skip
def test_structural_tag_refusals_name_the_field(tag, error, match):
    with pytest.raises(error, match=r"StructuredOutputsParams\.structural_tag" + match):
        StructuredOutputsParams(structural_tag=tag)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}}, ValueError,
         "logit_bias: 1025 tokens exceed the cap of MAX_LOGIT_BIAS_TOKENS=1024"),
        ({"logit_bias": {3: math.inf}}, ValueError, r"logit_bias\[3\] must be a finite number"),
        ({"logit_bias": {-1: 1.0}}, ValueError, "logit_bias: token ids must be ints >= 0"),
        ({"logit_bias": [1]}, TypeError, "logit_bias must be a dict"),
        ({"allowed_token_ids": []}, ValueError, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": list(range(MAX_ALLOWED_TOKEN_IDS + 1))}, ValueError,
         "MAX_ALLOWED_TOKEN_IDS=1024"),
        ({"allowed_token_ids": [1, -2]}, ValueError, "allowed_token_ids must be >= 0"),
        ({"allowed_token_ids": ["a"]}, TypeError, "allowed_token_ids must be a list of int"),
        ({"bad_words": ["ok", " "]}, ValueError, "bad_words must not contain blank words"),
        ({"bad_words": "word"}, TypeError, "bad_words must be a list of str"),
        ({"structured_outputs": "json"}, TypeError, "structured_outputs must be a"),
    ],
)  # fmt: skip
def test_sampling_params_refusals(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_clone_copies_and_rechecks_the_new_fields():
    sp = SamplingParams(logit_bias={1: 2}, allowed_token_ids=[1, 2], bad_words=["x"])
    copy = sp.clone()
    assert copy.logit_bias == {1: 2.0} and copy.logit_bias is not sp.logit_bias
    assert copy.allowed_token_ids is not sp.allowed_token_ids
    sp.allowed_token_ids = []  # set after construction: refused when the engine clones it
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        sp.clone()
