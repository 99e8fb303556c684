"""Tool-call parsers (jaxserve/entrypoints/openai/tool_parsers/) and the tool-call answers they
make (tool_calls.py): host-only."""

from __future__ import annotations

import json

import pytest

from jaxserve.entrypoints.openai.protocol import OpenAIError
from jaxserve.entrypoints.openai.protocol.tools import ToolChoice, tool_choice_of
from jaxserve.entrypoints.openai.tool_calls import ToolCallStream, chat_message
from jaxserve.entrypoints.openai.tool_parsers import FunctionCall, get_tool_parser

ARGS = {"city": "Paris", "days": 2}
CALL = FunctionCall("weather", json.dumps(ARGS))


@pytest.mark.parametrize(
    "parser, text, content",
    [
        ("hermes", "Let me check.<tool_call>\n"
                   f'{{"name": "weather", "arguments": {json.dumps(ARGS)}}}\n</tool_call>',
         "Let me check."),
        ("qwen", f'<tool_call>{{"name": "weather", "arguments": {json.dumps(ARGS)}}}</tool_call>',
         None),
        ("llama3_json", f'{{"name": "weather", "parameters": {json.dumps(ARGS)}}}', None),
        ("llama3_json", f'<|python_tag|>{{"name": "weather", "parameters": {json.dumps(ARGS)}}}',
         None),
        ("mistral", f'[TOOL_CALLS][{{"name": "weather", "arguments": {json.dumps(ARGS)}}}]', None),
        ("mistral", f"Sure [TOOL_CALLS]weather[ARGS]{json.dumps(ARGS)}", "Sure"),
    ],
)  # fmt: skip
def test_each_parser_reads_its_format(parser, text, content):
    got_content, calls = get_tool_parser(parser).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", ARGS)]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_text_without_calls_or_with_broken_ones_is_content(parser):
    p = get_tool_parser(parser)
    assert p.extract("Just words.") == ("Just words.", [])
    broken = {"hermes": "<tool_call>{oops", "llama3_json": "{oops", "mistral": "[TOOL_CALLS][{"}
    assert p.extract(broken[parser]) == (broken[parser], [])


def test_an_unknown_parser_is_named():
    with pytest.raises(ValueError, match=r"--tool-call-parser must be one of .*'hermes'"):
        get_tool_parser("nope")


def test_streamed_auto_answers_hold_back_what_may_start_a_call():
    stream = ToolCallStream(ToolChoice("auto", ()), get_tool_parser("hermes"))
    block = f'<tool_call>{{"name": "weather", "arguments": {json.dumps(ARGS)}}}</tool_call>'
    pieces = ["Hello ", "<tool", "_call>", block[len("<tool_call>") :]]
    deltas = [d for i, p in enumerate(pieces) for d in stream.deltas(p, i == len(pieces) - 1)]
    assert "".join(d.get("content", "") for d in deltas) == "Hello "
    (call,) = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == ARGS
    assert stream.finish_reason("stop") == "tool_calls"


def test_auto_without_parallel_calls_keeps_the_first():
    block = f'<tool_call>{{"name": "weather", "arguments": {json.dumps(ARGS)}}}</tool_call>'
    hermes = get_tool_parser("hermes")
    message, _ = chat_message(ToolChoice("auto", (), parallel=False), hermes, block * 2, "stop")
    assert len(message["tool_calls"]) == 1
    message, _ = chat_message(ToolChoice("auto", ()), hermes, block * 2, "stop")
    assert len(message["tool_calls"]) == 2


def test_forced_calls_make_messages_and_streams():
    tools = (
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
    )
    named = ToolChoice("named", tools, "weather")
    message, reason = chat_message(named, None, json.dumps(ARGS), "stop")
    assert message["content"] is None and reason == "stop"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == ARGS
    stream = ToolCallStream(named, None)
    deltas = stream.deltas('{"city"', False) + stream.deltas(': "Paris", "days": 2}', True)
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert json.loads(args) == ARGS and deltas[0]["tool_calls"][0]["id"].startswith("call_")
    required = ToolChoice("required", tools)
    text = json.dumps([{"name": "weather", "parameters": ARGS}])
    message, reason = chat_message(required, None, text, "stop")
    assert reason == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "weather"
    assert chat_message(required, None, '[{"name": "wea', "length")[0]["content"] == (
        '[{"name": "wea'
    )  # cut by max_tokens: no call


class _Req:
    def __init__(self, tools=None, tool_choice=None, parallel_tool_calls=None):
        self.tools, self.tool_choice = tools, tool_choice
        self.parallel_tool_calls = parallel_tool_calls


@pytest.mark.parametrize(
    "req, param, says",
    [
        (_Req(tool_choice="required"), "tool_choice", "needs tools"),
        (_Req([{"type": "function"}]), "tools[0]", "must be"),
        (_Req([{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name",
         "unique name"),
        (_Req([{"type": "function", "function": {"name": "f"}}],
              {"type": "function", "function": {"name": "g"}}), "tool_choice", "not among"),
        (_Req([{"type": "function", "function": {"name": "f"}}], "sometimes"), "tool_choice",
         "must be"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(req, param, says):
    with pytest.raises(OpenAIError) as info:
        tool_choice_of(req)
    assert info.value.param == param and says in str(info.value), str(info.value)


def test_required_schema_allows_one_call_without_parallel_calls():
    tools = [{"type": "function", "function": {"name": "f"}}]
    choice = tool_choice_of(_Req(tools, "required", False))
    schema = choice.constraint()["json"]
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert tool_choice_of(_Req(tools, "none")).template_tools is None
