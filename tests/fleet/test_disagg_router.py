"""``jaxserve router`` (disagg.py) over real engine servers (one server as producer and
consumer): greedy answers identical to one colocated engine, streamed and whole; each request
is prefilled once with max_tokens 1; a producer that is gone does not fail the request (the
consumer computes the prompt); a producer's 400 is the client's and nothing is decoded; a
client that leaves mid-stream frees every block."""

from __future__ import annotations

import socket

import pytest
from server_utils import MODEL, client, http, metrics, num_aborted, running_server, wait_engine_idle

from jaxserve.fleet.backends import BackendPool
from jaxserve.fleet.disagg import build_router_app, prefill_body, router_pools

PROMPTS = ["The capital of France is", "1 2 3 4 5 6"]


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def router_url(engine_url):
    app = build_router_app(BackendPool([engine_url]), BackendPool([engine_url]),
                           pass_kv_transfer_params=False)  # fmt: skip
    with running_server(app) as url:
        yield url


def _greedy(base_url: str, prompt: str, stream: bool = False) -> str:
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0)
    if not stream:
        return client(base_url).completions.create(**kwargs).choices[0].text
    chunks = client(base_url).completions.create(stream=True, **kwargs)
    return "".join(chunk.choices[0].text for chunk in chunks)


def _generation_tokens(url: str) -> float:
    return metrics(url)[("jaxserve:generation_tokens_total", ())]


def test_greedy_answers_equal_one_colocated_engine(engine_url, router_url):
    for prompt in PROMPTS:
        direct = _greedy(engine_url, prompt)
        before = _generation_tokens(engine_url)
        assert _greedy(router_url, prompt) == direct
        assert _generation_tokens(engine_url) == before + 1 + 6  # prefill's one token, decode's
        assert _greedy(router_url, prompt, stream=True) == direct
    chat = client(router_url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert chat.usage.completion_tokens == 3


def test_the_prefill_request_is_one_token_not_streamed():
    body = {"prompt": "p", "max_tokens": 50, "stream": True, "n": 2, "min_tokens": 9}
    sent = prefill_body(body)
    assert sent["max_tokens"] == 1 and "stream" not in sent and "n" not in sent
    assert "min_tokens" not in sent and body["max_tokens"] == 50  # the client's is untouched
    assert sent["kv_transfer_params"] == {"do_remote_decode": True}
    with pytest.raises(ValueError, match="--decode needs at least one"):
        router_pools(["http://a:1"], [])
    with pytest.raises(ValueError, match="not an http"):
        router_pools(["a:1"], ["http://b:2"])


def test_a_producer_gone_still_answers_and_its_400_is_the_clients(engine_url):
    app = build_router_app(BackendPool([_dead_url()]), BackendPool([engine_url]),
                           pass_kv_transfer_params=False)  # fmt: skip
    with running_server(app) as url:
        assert _greedy(url, PROMPTS[0]) == _greedy(engine_url, PROMPTS[0])
    app = build_router_app(BackendPool([engine_url]), BackendPool([_dead_url()]),
                           pass_kv_transfer_params=False)  # fmt: skip
    with running_server(app) as url:
        before = _generation_tokens(engine_url)
        status, _, body = http(f"{url}/v1/completions", {"model": MODEL, "prompt": "x",
                                                         "temperature": -1})  # fmt: skip
        assert status == 400 and b"temperature" in body
        assert _generation_tokens(engine_url) == before
        assert http(f"{url}/health")[0] == 503


def test_a_client_that_leaves_mid_decode_frees_every_block(engine_url, router_url):
    aborted = num_aborted(engine_url)
    stream = client(router_url).completions.create(
        model=MODEL, prompt="x y " * 4, max_tokens=80, stream=True, extra_body={"min_tokens": 80}
    )
    next(iter(stream))
    stream.close()
    samples = wait_engine_idle(engine_url)
    assert samples[("jaxserve:kv_cache_usage_perc", ())] == 0
    assert num_aborted(engine_url) == aborted + 1


def test_router_command_refuses_bad_urls_with_code_2(capsys):
    import logging

    from jaxserve import cli

    logger = logging.getLogger("jaxserve")  # the command gives it a handler: restored below
    handlers, level = list(logger.handlers), logger.level
    try:
        _bad_router_commands(cli, capsys)
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)


def _bad_router_commands(cli, capsys) -> None:
    assert cli.main(["router", "--prefill", "127.0.0.1:1", "--decode", "http://a:2"]) == 2
    assert "--prefill: '127.0.0.1:1' is not an http" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["router", "--prefill", "http://a:1"])
    assert info.value.code == 2 and "--decode" in capsys.readouterr().err
