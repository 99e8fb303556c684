"""protocol.py without an engine: request bodies -> prompts and SamplingParams, the 400s that
name the field, and the logprobs / usage / error bodies."""

from __future__ import annotations

import math

import pytest

from jaxserve.entrypoints.openai.protocol import (
    LOGPROB_FLOOR,
    OpenAIError,
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    completion_prompts,
    loc_path,
    parse_chat_request,
    parse_completion_request,
    prompt_logprobs_body,
    sampling_params,
    sse,
    usage,
)
from jaxserve.outputs import Logprob
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

DELTA = RequestOutputKind.DELTA
MESSAGES = [{"role": "user", "content": "Hi"}]


def error_of(parse, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(body)
    assert info.value.status_code == 400
    return info.value


def test_error_body_is_openais():
    error = OpenAIError("busy", status_code=503)
    assert error.body() == {
        "error": {"message": "busy", "type": "ServiceUnavailableError", "param": None, "code": 503}
    }
    assert OpenAIError("x", param="n").body()["error"]["type"] == "BadRequestError"


def test_completion_fields_map_to_sampling_params():
    request = parse_completion_request(
        {
            "model": "m",
            "prompt": "Hello",
            "n": 2,
            "temperature": 0.5,
            "top_p": 0.9,
            "stop": ["a", "b"],
            "seed": 7,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "user": "someone",
            "logprobs": 3,
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "stop_token_ids": [7],
            "ignore_eos": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "prompt_logprobs": 1,
            "best_of": 2,
            "logit_bias": {},
        }
    )
    params = sampling_params(request, max_tokens=request.max_tokens, output_kind=DELTA)
    assert params == SamplingParams(
        n=2,
        temperature=0.5,
        top_p=0.9,
        stop=["a", "b"],
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=3,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        min_tokens=2,
        stop_token_ids=[7],
        ignore_eos=True,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        prompt_logprobs=1,
        max_tokens=16,
        output_kind=DELTA,
    )
    defaults = parse_completion_request({"prompt": "x"})
    assert sampling_params(defaults, max_tokens=16, output_kind=DELTA) == SamplingParams(
        output_kind=DELTA
    )


def test_chat_logprobs_and_max_completion_tokens_map_to_sampling_params():
    request = parse_chat_request(
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 4, "max_completion_tokens": 9}
    )
    params = sampling_params(request, max_tokens=9, output_kind=DELTA)
    assert params.logprobs == 4 and params.max_tokens == 9
    request = parse_chat_request({"messages": MESSAGES, "logprobs": True})
    assert sampling_params(request, max_tokens=1, output_kind=DELTA).logprobs == 0
    request = parse_chat_request({"messages": MESSAGES, "logprobs": False})
    assert sampling_params(request, max_tokens=1, output_kind=DELTA).logprobs is None
    same = parse_chat_request({"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 5})
    assert same.max_completion_tokens == 5


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"prompt": "x", "foo": 1}, "foo", "unknown field 'foo'"),
        ({}, "prompt", "required"),
        ({"prompt": "x", "n": True}, "n", "valid integer"),
        ({"prompt": "x", "temperature": "1"}, "temperature", "'1'"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"prompt": "x", "stream": True, "stream_options": {"x": 1}}, "stream_options.x", "x"),
        ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ({"prompt": "x", "best_of": 2, "n": 1}, "best_of", "n (1)"),
        ({"prompt": "x", "echo": True, "stream": True}, "echo", "stream to false"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "only with echo=true"),
    ],
)
def test_bad_completion_bodies_name_the_field(body, param, says):
    error = error_of(parse_completion_request, body)
    assert error.param == param and says in error.message, error.message


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"messages": MESSAGES, "functions": [{}]}, "functions", "function calling"),
        ({"messages": MESSAGES, "max_tokens": 3, "max_completion_tokens": 4},
         "max_completion_tokens", "differ"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "logprobs=true"),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role", "valid string"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "required"),
        ({"messages": MESSAGES, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs", "stream"),
        ({"messages": "Hi"}, "messages", "valid list"),
    ],
)  # fmt: skip
def test_bad_chat_bodies_name_the_field(body, param, says):
    error = error_of(parse_chat_request, body)
    assert error.param == param and says in error.message, error.message


def test_neutral_values_of_unsupported_fields_are_accepted():
    parse_chat_request(
        {
            "messages": MESSAGES,
            "tools": None,
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "logit_bias": {},
            "n": 2,
            "best_of": 2,
        }
    )


def test_a_body_that_is_not_an_object_is_refused():
    assert "JSON object" in error_of(parse_completion_request, [1, 2]).message


@pytest.mark.parametrize(
    ("field", "value", "param", "says"),
    [
        ("temperature", -1.0, "temperature", "temperature must be >= 0, got -1.0"),
        ("top_p", 0.0, "top_p", "top_p must be in (0, 1]"),
        ("stop", 5, "stop", "stop must be a str or a list of str"),
        ("min_tokens", 99, "min_tokens", "max_tokens=16"),
        ("max_tokens", -1, "max_tokens", "max_tokens must be >= 1, got -1"),
        ("logprobs", 21, "logprobs", "[0, 20], got 21"),
        ("stop_token_ids", [-1], "stop_token_ids", ">= 0"),
    ],
)
def test_sampling_params_errors_name_the_request_field(field, value, param, says):
    request = parse_completion_request({"prompt": "x", field: value})
    with pytest.raises(OpenAIError) as info:
        sampling_params(request, max_tokens=request.max_tokens, output_kind=DELTA)
    assert info.value.param == param and says in info.value.message
    assert "SamplingParams" not in info.value.message


def test_chat_top_logprobs_errors_name_top_logprobs():
    request = parse_chat_request({"messages": MESSAGES, "logprobs": True, "top_logprobs": 25})
    with pytest.raises(OpenAIError) as info:
        sampling_params(request, max_tokens=5, output_kind=DELTA)
    assert info.value.param == "top_logprobs" and "25" in info.value.message


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("Hi", ["Hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_the_four_prompt_forms(prompt, expected):
    assert completion_prompts(parse_completion_request({"prompt": prompt})) == expected


@pytest.mark.parametrize("prompt", [[], [1, "a"], [True, 2], [[1], ["a"]], 5, {"a": 1}, None])
def test_bad_prompts_are_refused(prompt):
    request = parse_completion_request({"prompt": prompt})
    with pytest.raises(OpenAIError) as info:
        completion_prompts(request)
    assert info.value.param == "prompt"


def test_chat_messages_join_text_parts_and_refuse_the_rest():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = parse_chat_request(
        {"messages": [{"role": "user", "content": parts, "name": "bob"}, {"role": "assistant",
         "content": "c", "tool_calls": None, "refusal": None}]}
    )  # fmt: skip
    assert chat_messages(request) == [
        {"role": "user", "content": "a\nb", "name": "bob"},
        {"role": "assistant", "content": "c"},
    ]
    for message, param in [
        ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "content[0]"),
        ({"role": "user", "content": None}, "content"),
        ({"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}, "tool_calls[0]"),
    ]:
        with pytest.raises(OpenAIError) as info:
            chat_messages(parse_chat_request({"messages": [message]}))
        assert info.value.param == f"messages[0].{param}"


def test_loc_path():
    assert loc_path(("messages", 0, "content", 2)) == "messages[0].content[2]"
    assert loc_path(("stream_options", "x")) == "stream_options.x"


# Two positions: the sampled token first (rank 2 at the first), then the top-2.
POSITIONS = [
    {7: Logprob(-1.5, 2, "b"), 5: Logprob(-0.5, 1, "a"), 9: Logprob(-2.0, 3, "c")},
    {5: Logprob(-math.inf, 1, "a"), 7: Logprob(-3.0, 2, "bb")},
]


def test_completion_logprobs_body():
    body = completion_logprobs(POSITIONS, 2, tokenizer=None, text_offset=10)
    assert body == {
        "tokens": ["b", "a"],
        "token_logprobs": [-1.5, LOGPROB_FLOOR],
        "top_logprobs": [{"a": -0.5, "b": -1.5}, {"a": LOGPROB_FLOOR, "bb": -3.0}],
        "text_offset": [10, 11],
    }
    assert completion_logprobs(POSITIONS, 0, tokenizer=None)["top_logprobs"] == [{}, {}]


def test_chat_logprobs_body():
    body = chat_logprobs(POSITIONS[:1], 1, tokenizer=None)
    assert body == {
        "content": [
            {
                "token": "b",
                "logprob": -1.5,
                "bytes": [98],
                "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}],
            }
        ]
    }
    no_text = chat_logprobs([{3: Logprob(-1.0, 1, None)}], 0, tokenizer=None)
    assert no_text["content"][0]["token"] == "token_id:3"


def test_prompt_logprobs_usage_and_events():
    assert prompt_logprobs_body(None) is None
    assert prompt_logprobs_body([None, {4: Logprob(-1.0, 3, "x")}]) == [
        None,
        {"4": {"logprob": -1.0, "rank": 3, "decoded_token": "x"}},
    ]
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert sse({"a": "é"}) == 'data: {"a": "é"}\n\n'
