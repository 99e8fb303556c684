"""The OpenAI-compatible server end to end: the real openai client against build_app served by
uvicorn on 127.0.0.1 (completions, chat, streaming, usage, n, logprobs, stop, seeds, errors,
the API key, /health and /metrics)."""

from __future__ import annotations

import json

import openai
import pytest
from server_utils import MODEL, SMALL, client, http, metrics, running_server

from jaxserve import LLM
from jaxserve.entrypoints.openai.api_server import build_app

KEY = "test-key"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def keyed_url(engine):
    """A second app on the same engine, with an API key."""
    with running_server(build_app(engine, served_model_name=MODEL, api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base_url):
    return client(base_url)


def prompt_len(llm_engine, prompt: str) -> int:
    return len(llm_engine.tokenizer.encode(prompt).ids)


def test_models_lists_the_served_model(oai, llm_engine):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "jaxserve"


def test_streamed_completion_equals_the_non_streamed_greedy_one(oai, llm_engine):
    full = oai.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    (choice,) = full.choices
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.prompt_tokens == prompt_len(llm_engine, PROMPT)
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12

    stream = oai.completions.create(
        model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert {c.object for c in chunks} == {"text_completion"}
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    with_choices = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in with_choices][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_streamed_chat_equals_the_non_streamed_greedy_one(oai, llm_engine):
    full = oai.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    (choice,) = full.choices
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    rendered = llm_engine.render_chat_prompt(MESSAGES)
    assert full.usage.prompt_tokens == len(rendered["prompt_token_ids"])
    assert full.usage.completion_tokens == 12

    stream = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_usage_counts_the_prompt_and_the_generated_tokens(oai, llm_engine):
    # Without ignore_eos the completion may end early: its length is that of its logprobs.
    out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, logprobs=0, seed=3)
    (choice,) = out.choices
    assert out.usage.completion_tokens == len(choice.logprobs.tokens) >= 1
    assert out.usage.prompt_tokens == prompt_len(llm_engine, PROMPT)
    ids = [1, 50, 60, 70, 80]
    out = oai.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 12


def test_n_and_a_batch_of_prompts_give_one_choice_per_sample(oai, llm_engine):
    prompts = ["a b", "c d e"]
    out = oai.completions.create(
        model=MODEL,
        prompt=prompts,
        n=2,
        temperature=1.0,
        seed=11,
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text != out.choices[1].text  # each sample has a seed of its own
    assert out.usage.prompt_tokens == sum(prompt_len(llm_engine, p) for p in prompts)
    assert out.usage.completion_tokens == 4 * 6

    chat = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, seed=5, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens == 12
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=2,
        seed=5,
        max_tokens=6,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in chat.choices]


def test_completion_logprobs_have_one_entry_per_token(oai):
    out = oai.completions.create(model=MODEL, prompt=PROMPT, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for token_logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3  # two tokens may decode to the same text
        assert token_logprob <= 0
        assert token_logprob == pytest.approx(max(top.values()))  # greedy: the most likely
    assert "".join(lp.tokens) == out.choices[0].text

    stream = oai.completions.create(model=MODEL, prompt=PROMPT, logprobs=3, stream=True, **GREEDY)
    tokens, offsets = [], []
    for chunk in stream:
        tokens += chunk.choices[0].logprobs.tokens
        offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs_have_top_logprobs_entries(oai):
    out = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 12
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    plain = oai.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert (
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY).choices[0].logprobs
        is None
    )


def test_stop_strings_end_the_text(oai):
    text = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, **_no_max(GREEDY))
    text = text.choices[0].text
    stop = next(
        text[k : k + 2]
        for k in range(2, len(text) - 2)
        if "\ufffd" not in text[k : k + 2] and text[k : k + 2].strip()
    )
    cut = text.index(stop)
    out = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, stop=[stop], **_no_max(GREEDY)
    )
    assert out.choices[0].text == text[:cut] and out.choices[0].finish_reason == "stop"
    out = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=16,
        stop=stop,
        temperature=0.0,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert out.choices[0].text == text[: cut + len(stop)]


def _no_max(params: dict) -> dict:
    return {k: v for k, v in params.items() if k != "max_tokens"}


def test_a_seed_makes_sampling_reproducible(oai):
    def sample(seed: int) -> str:
        out = oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            temperature=1.0,
            seed=seed,
            max_tokens=10,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)
    chat = [
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, seed=9, max_tokens=8)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert chat[0] == chat[1]


def test_echo_with_max_tokens_0_returns_the_prompts_logprobs(oai, llm_engine):
    """OpenAI's old way to score a prompt: echo, logprobs, max_tokens=0."""
    from jaxserve.engine.scoring import SCORE_PARAMS, continuation_logprobs

    ids = llm_engine.tokenizer.encode(PROMPT).ids
    full = oai.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    choice = full.choices[0]
    assert choice.text == PROMPT and full.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # The same numbers as scoring the prompt's tokens after its first one (an engine of its
    # own: the server's is driven by its AsyncLLM).
    (out,) = LLM("tiny-random-llama", **SMALL).generate(
        [{"prompt_token_ids": ids}], SCORE_PARAMS, use_tqdm=False
    )
    expected = continuation_logprobs(out, 1)
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    # With generated tokens too: the prompt's text and logprobs, then the completion's.
    both = oai.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, **GREEDY)
    plain = oai.completions.create(model=MODEL, prompt=PROMPT, logprobs=1, **GREEDY)
    assert both.choices[0].text == PROMPT + plain.choices[0].text
    assert both.choices[0].logprobs.tokens[len(ids) :] == plain.choices[0].logprobs.tokens
    assert both.usage == plain.usage


BAD_REQUESTS = [
    ("completions", {"prompt": PROMPT, "extra_body": {"foo": 1}}, "foo", "unknown field"),
    ("completions", {"prompt": PROMPT, "temperature": -1.0}, "temperature", ">= 0, got -1"),
    ("completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature", "'hot'"),
    ("completions", {"prompt": list(range(3, 203))}, "prompt", "max_model_len=128"),
    ("completions", {"prompt": PROMPT, "max_tokens": 200}, "max_tokens", "128"),
    ("completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens", "only with echo=true"),
    ("completions", {"prompt": PROMPT, "max_tokens": -1}, "max_tokens", ">= 1, got -1"),
    ("completions", {"prompt": PROMPT, "echo": True, "stream": True}, "echo", "stream"),
    ("completions", {"prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ("completions", {"prompt": PROMPT, "best_of": 3}, "best_of", "best_of"),
    ("completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs", "[0, 20], got 21"),
    ("completions", {"prompt": [1, 5000]}, "prompt", "outside the vocabulary"),
    (
        "completions",
        {"prompt": PROMPT, "stream": True, "extra_body": {"prompt_logprobs": 1}},
        "prompt_logprobs",
        "stream",
    ),
    (
        "chat",
        {"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 6},
        "max_completion_tokens",
        "differ",
    ),
    ("chat", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 30}, "top_logprobs", "30"),
    ("chat", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "logprobs=true"),
    ("chat", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0]", "must be"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content", "string"),
    (
        "chat",
        {"messages": [{"role": "user", "content": "hello " * 150}]},
        "messages",
        "max_model_len",
    ),
    ("chat", {"messages": MESSAGES, "extra_body": {"top_k": 0}}, "top_k", "got 0"),
]


@pytest.mark.parametrize(("endpoint", "kwargs", "param", "says"), BAD_REQUESTS)
def test_bad_requests_are_400_naming_the_field(oai, endpoint, kwargs, param, says):
    create = oai.completions.create if endpoint == "completions" else oai.chat.completions.create
    with pytest.raises(openai.BadRequestError) as info:
        create(model=MODEL, **kwargs)
    error = info.value.body
    assert info.value.status_code == 400
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param
    assert says in error["message"], error["message"]


def test_every_error_is_an_openai_error_body(base_url):
    def post(body, path="/v1/completions"):
        status, headers, raw = http(base_url + path, body)
        return status, json.loads(raw)["error"]

    status, error = post(b"{not json")
    assert status == 400 and "not valid JSON" in error["message"]
    status, error = post(b"[1, 2]")
    assert status == 400 and "JSON object" in error["message"]
    status, error = post({"model": "other", "prompt": "x"})
    assert status == 404 and error["type"] == "NotFoundError" and error["param"] == "model"
    status, error = post({"prompt": "x"}, "/v1/nothing")
    assert status == 404 and error["code"] == 404
    status, _, raw = http(base_url + "/v1/completions")  # GET
    assert status == 405 and json.loads(raw)["error"]["code"] == 405


def test_a_raw_stream_is_server_sent_events_ending_with_done(base_url):
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": 4, "temperature": 0}
    status, headers, raw = http(base_url + "/v1/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event[len("data: ") :])["object"] == "text_completion"


def test_prompt_logprobs_come_with_the_choice(base_url, llm_engine):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1}
    status, _, raw = http(base_url + "/v1/completions", body)
    assert status == 200
    prompt_logprobs = json.loads(raw)["choices"][0]["prompt_logprobs"]
    assert len(prompt_logprobs) == prompt_len(llm_engine, PROMPT)
    assert prompt_logprobs[0] is None
    assert all(1 <= len(p) <= 2 for p in prompt_logprobs[1:])


def test_the_api_key_guards_v1_but_not_health_and_metrics(keyed_url):
    for key in ("wrong", None):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        status, _, raw = http(keyed_url + "/v1/models", headers=headers)
        assert status == 401
        assert json.loads(raw)["error"]["type"] == "AuthenticationError"
    with pytest.raises(openai.AuthenticationError):
        client(keyed_url, api_key="wrong").completions.create(model=MODEL, prompt="x")
    good = client(keyed_url, api_key=KEY)
    assert [m.id for m in good.models.list().data] == [MODEL]
    out = good.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    assert http(keyed_url + "/health")[0] == 200
    assert http(keyed_url + "/metrics")[0] == 200


def test_health_and_metrics(base_url):
    assert http(base_url + "/health")[0] == 200
    status, headers, _ = http(base_url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples = metrics(base_url)
    assert ("jaxserve:num_requests_running", ()) in samples
    assert samples[("jaxserve:generation_tokens_total", ())] > 0
