"""Structured outputs and logit_bias through the OpenAI server, with the real openai client:
response_format (json_object, json_schema) on both routes, vLLM's structured_outputs,
logit_bias, and the 400s of constraints that cannot be honoured."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_utils import MODEL, client, running_server

from jaxserve import AsyncLLM
from jaxserve.entrypoints.openai.api_server import build_app

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "rank": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["city", "rank", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Give me JSON."}]


@pytest.fixture(scope="module")
def engine(llm_engine):
    engine = AsyncLLM.from_engine(llm_engine, served_model_name=MODEL)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def oai(engine):
    with running_server(build_app(engine, served_model_name=MODEL)) as url:
        yield client(url)


def test_response_format_json_schema_and_json_object_on_both_routes(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}
    chat = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=3, n=2,
        response_format=fmt,
    )  # fmt: skip
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    comp = oai.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=60, temperature=0.0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert isinstance(json.loads(comp.choices[0].text), dict)


def test_structured_outputs_extra_field_and_logit_bias(oai, llm_engine):
    choices = ["alpha", "beta"]
    chat = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=1,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert chat.choices[0].message.content in choices
    forced = oai.completions.create(
        model=MODEL, prompt="Hi", max_tokens=4, temperature=1.0, logit_bias={"500": 100}
    )
    assert forced.choices[0].text == llm_engine.tokenizer.decode([500] * 4)


@pytest.mark.parametrize(
    "extra, param, match",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "u", "schema": {"type": "array", "uniqueItems": True}}}},
         "response_format", r"response_format.json: Unimplemented keys"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "u"}}},
         "response_format.json_schema.schema", "must be a JSON schema object"),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format must be"),
        ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs",
         r"structured_outputs.grammar: .*nope"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "structured_outputs", "each constrain the output"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias",
         "MAX_LOGIT_BIAS_TOKENS=1024"),
        ({"logit_bias": {"5": 200}}, "logit_bias", r"must be a number in \[-100, 100\]"),
        ({"logit_bias": {"five": 1}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", r"token id 99999 is outside the vocabulary"),
    ],
)  # fmt: skip
def test_constraints_that_cannot_be_honoured_are_400s_naming_the_field(
    oai, llm_engine, extra, param, match
):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=extra)
    error = info.value.body
    assert error["param"] == param, error
    assert re.search(match, error["message"]), error["message"]
    assert not llm_engine.has_unfinished_requests()
