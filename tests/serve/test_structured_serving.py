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


def test_json_schema_strict_false_is_enforced_all_the_same(oai):
    outs = []
    for strict in (True, False, None):
        spec = {"name": "c", "schema": SCHEMA, **({} if strict is None else {"strict": strict})}
        out = oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0.0,
            response_format={"type": "json_schema", "json_schema": spec},
        )  # fmt: skip
        outs.append(out.choices[0].message.content)
        jsonschema.validate(json.loads(outs[-1]), SCHEMA)
    assert outs[0] == outs[1] == outs[2]


def test_response_format_structural_tag(oai, llm_engine):
    (trigger,) = llm_engine.tokenizer.encode("all", add_special_tokens=False).ids
    flag = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "structural_tag", "triggers": ["all"],
           "structures": [{"begin": "all=", "schema": flag, "end": ";"}]}  # fmt: skip
    chat = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, temperature=1.0, seed=2,
        logit_bias={str(trigger): 100}, response_format=fmt,
    )  # fmt: skip
    text = chat.choices[0].message.content  # the bias writes the trigger whenever text may come
    tags = re.findall(r"all=(\{.*?\});", text)
    assert len(tags) >= 2 and text.startswith("all="), text
    for tag in tags:
        jsonschema.validate(json.loads(tag), flag)


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
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": SCHEMA, "strict": "yes"}}},
         "response_format.json_schema.strict", "must be a boolean"),
        ({"response_format": {"type": "structural_tag", "triggers": ["<f="], "structures": [
            {"begin": "<g>", "schema": {}, "end": ""}]}},
         "response_format", r"response_format.structural_tag.structures\[0\].begin '<g>' starts "
         r"with none of the triggers"),
        ({"response_format": {"type": "structural_tag", "format": {}}},
         "response_format", r"response_format.structural_tag.format: xgrammar's"),
        ({"structured_outputs": {"structural_tag": '{"triggers": []}'}},
         "structured_outputs", r"structured_outputs.structural_tag.triggers must be a non-empty"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs",
         r"structured_outputs.choice must be non-empty"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
         r"structured_outputs: exactly one of"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}],
          "tool_choice": "required"}, "tools[0].function.strict", "must be a boolean"),
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


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "noop", "description": "does nothing"}},
]
NAMED = {"type": "function", "function": {"name": "weather"}}


def _reassemble(chunks) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    reason = None
    for chunk in chunks:
        (choice,) = chunk.choices
        reason = choice.finish_reason or reason
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_forced_tool_calls_validate_and_stream_the_same(oai, tool_choice):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                  max_tokens=60, temperature=0.0)  # fmt: skip
    full = oai.chat.completions.create(**kwargs)
    (choice,) = full.choices
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        if call.function.name == "weather":
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    forced = tool_choice == "required"
    assert choice.finish_reason == ("tool_calls" if forced else "stop")
    streamed, reason = _reassemble(oai.chat.completions.create(stream=True, **kwargs))
    expected = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in choice.message.tool_calls]  # fmt: skip
    assert streamed == expected and reason == choice.finish_reason


def test_tool_messages_go_through_the_chat_template(oai):
    arguments = '{"city": "Oslo", "days": 1}'
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": arguments}}  # fmt: skip
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=3
    )
    assert out.choices[0].message.tool_calls is None
    assert out.usage.prompt_tokens > 20  # the tool turn is in the prompt


def test_auto_needs_a_parser_and_then_reads_calls_from_the_text(oai, engine):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=3)
    assert info.value.body["param"] == "tool_choice"
    block = '<tool_call>{"name": "weather", "arguments": {"city": "Rome", "days": 3}}</tool_call>'
    # (64 tokens of the demo tokenizer: the choice forces the model to write it)
    app = build_app(engine, served_model_name=MODEL, tool_call_parser="hermes")
    with running_server(app) as url:
        hermes = client(url)
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=80,
                      extra_body={"structured_outputs": {"choice": [block]}})  # fmt: skip
        out = hermes.chat.completions.create(**kwargs)
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "weather" and out.choices[0].finish_reason == "tool_calls"
        assert json.loads(call.function.arguments) == {"city": "Rome", "days": 3}
        streamed, reason = _reassemble(hermes.chat.completions.create(stream=True, **kwargs))
        assert [json.loads(c["arguments"]) for c in streamed] == [{"city": "Rome", "days": 3}]
        assert reason == "tool_calls"
