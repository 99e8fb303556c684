"""What a hostile or careless client sends, answered with a 400 / 413 naming the field, while
the server serves everyone else: huge and deep bodies, non-finite numbers, its own chat template,
a disconnect before the answer. Each test talks to a real server on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import openai
import pytest
from server_utils import MODEL, TIMEOUT_S, client, http, running_server, wait_engine_idle

from jaxserve import AsyncLLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.body import BodyLimits

MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def base_url(llm_engine):
    engine = AsyncLLM.from_engine(llm_engine, served_model_name=MODEL)
    app = build_app(engine, served_model_name=MODEL, body_limits=BodyLimits(max_bytes=MAX_BODY))
    try:
        with running_server(app) as url:
            yield url
    finally:
        engine.shutdown()


def _post(url: str, path: str, raw: bytes) -> tuple[int, dict]:
    status, _, body = http(url + path, body=raw, method="POST")
    return status, json.loads(body)


def test_a_body_over_the_limit_gets_413_without_being_read(base_url):
    """The headers alone are answered: the client never sends the body (a client that does
    may see its connection closed part-way, as the server stops reading)."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 10)
        )
        head, _, rest = _read_response(sock)
    assert head.startswith(b"HTTP/1.1 413"), head
    error = json.loads(rest)
    assert "--max-request-body-bytes" in error["error"]["message"]
    assert str(MAX_BODY) in error["error"]["message"]


def _read_response(sock: socket.socket) -> tuple[bytes, bytes, bytes]:
    """(status line and headers, separator, body) of one response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, sep, rest = data.partition(b"\r\n\r\n")
    length = int(
        next(
            h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
        )
    )
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, rest
        rest += chunk
    return head, sep, rest


def test_a_body_without_content_length_is_counted_as_it_arrives(base_url):
    host, port = base_url.removeprefix("http://").split(":")
    chunk = b"x" * 65536
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        try:
            for _ in range(MAX_BODY // len(chunk) + 2):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:  # the server may answer and close before the last chunk
            pass
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


def test_a_prompt_far_over_max_model_len_is_refused_before_it_is_tokenized(base_url):
    # Under the body limit, and about 900k characters: the bound refuses it without counting.
    prompt = "word " * 180_000
    started = time.monotonic()
    with client(base_url) as c, pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert info.value.body["param"] == "prompt"
    assert "refused before tokenizing" in info.value.body["message"]
    assert time.monotonic() - started < TIMEOUT_S


def test_health_answers_while_a_long_prompt_is_tokenized(base_url):
    # Just under the early bound: it is tokenized, off the event loop, while /health answers.
    done = threading.Event()
    results = {}

    def long_request():
        with client(base_url) as c:
            try:
                c.completions.create(model=MODEL, prompt="ab " * 30_000, max_tokens=1)
            except openai.BadRequestError as e:
                results["error"] = e.body
        done.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    statuses = []
    while not done.is_set() and len(statuses) < 1000:
        statuses.append(http(base_url + "/health")[0])
    thread.join(TIMEOUT_S)
    assert statuses and set(statuses) == {200}
    assert results["error"]["param"] == "prompt"  # too long for max_model_len, when counted


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "%s", "prompt": "hi", "temperature": Infinity}', "temperature"),
        (b'{"model": "%s", "prompt": "hi", "temperature": 1e400}', "temperature"),
        (b'{"model": "%s", "prompt": "hi", "top_p": NaN}', "top_p"),
        (b'{"model": "%s", "prompt": "hi", "presence_penalty": -Infinity}', "presence_penalty"),
    ],
)
def test_non_finite_numbers_are_a_400_naming_the_field(base_url, raw, param):
    status, error = _post(base_url, "/v1/completions", raw % MODEL.encode())
    assert status == 400, error
    assert error["error"]["param"] == param
    assert error["error"]["message"].startswith(f"{param}:")


def test_a_body_nested_100k_deep_is_a_400_not_a_500(base_url):
    raw = b'{"model": "m", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, error = _post(base_url, "/v1/completions", raw)
    assert status == 400, error
    assert "deeper than" in error["error"]["message"]


def test_a_request_chat_template_is_refused_unless_the_operator_trusts_it(base_url, llm_engine):
    messages = [{"role": "user", "content": "hi"}]
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with client(base_url) as c, pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, extra_body={"chat_template": template}
        )
    assert info.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in info.value.body["message"]


def test_a_trusted_template_is_still_bounded(llm_engine):
    engine = AsyncLLM.from_engine(llm_engine, served_model_name=MODEL)
    app = build_app(engine, served_model_name=MODEL, trust_request_chat_template=True)
    nested = "{% for i in range(8000) %}{% for j in range(8000) %}{% endfor %}{% endfor %}x"
    messages = [{"role": "user", "content": "hi"}]
    try:
        with running_server(app) as url, client(url) as c:
            out = c.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=2,
                extra_body={"chat_template": "{{ messages[0]['content'] }}"},
            )
            assert out.choices[0].finish_reason in ("length", "stop")
            started = time.monotonic()
            with pytest.raises(openai.BadRequestError) as info:
                c.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=1,
                    extra_body={"chat_template": nested},
                )  # fmt: skip
            assert time.monotonic() - started < TIMEOUT_S
            assert "MAX_TEMPLATE_LOOP_ITERATIONS" in info.value.body["message"]
    finally:
        engine.shutdown()


def test_a_client_that_disconnects_gets_no_500_and_leaves_no_traceback(base_url, caplog):
    host, port = base_url.removeprefix("http://").split(":")
    body = json.dumps(
        {"model": MODEL, "prompt": "hello", "max_tokens": 48, "ignore_eos": True}
    ).encode()
    caplog.set_level(logging.DEBUG, logger="jaxserve")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        time.sleep(0.05)  # the request has started
    samples = wait_engine_idle(base_url)
    assert samples[("jaxserve:num_requests_running", ())] == 0
    time.sleep(0.2)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "%s", "prompt": "hi", "\\ud800x": 1}', "\\ud800x"),
        (b'{"model": "%s", "prompt": "hi", "logit_bias": {"\\udfff": 1}}', "logit_bias.\\udfff"),
        (b'{"model": "%s", "prompt": "hi", "stop": ["\\ud800"]}', "stop[0]"),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(base_url, raw, param):
    """Not UTF-8 encodable: a field name (or string) holding one cannot even be echoed back."""
    status, error = _post(base_url, "/v1/completions", raw % MODEL.encode())
    assert status == 400, error
    assert error["error"]["param"] == param
    assert error["error"]["message"].startswith(f"{param}:")
    assert "lone surrogate" in error["error"]["message"]
