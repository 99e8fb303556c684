"""vLLM's kv_transfer_params through the router (``pass_kv_transfer_params``): a prefill's answer
says how many prompt tokens of KV it stored, the router hands that to the decode server, and a
decode server with ``kv_load_failure_policy`` "fail" answers 500 (naming the policy) when that
KV cannot be loaded, and the right tokens when it can. One engine server (kv_both, its own
store) serves both roles; a stub prefill server makes a promise no store keeps."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from server_utils import MODEL, SMALL, client, http, running_server

from jaxserve import AsyncLLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.fleet.backends import BackendPool
from jaxserve.fleet.disagg import build_router_app

PROMPT = "The capital of France is a city of many bridges and"  # > 1 block of 8 tokens


@pytest.fixture(scope="module")
def kv_url(tmp_path_factory):
    """An engine server that saves and loads KV (kv_both), failing requests whose promised KV
    it cannot load."""
    kv = {
        "kv_role": "kv_both",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path_factory.mktemp("kv"))},
    }
    engine = AsyncLLM(model="tiny-random-llama", served_model_name=MODEL,
                      kv_transfer_config=kv, **SMALL)  # fmt: skip
    try:
        with running_server(build_app(engine, served_model_name=MODEL)) as url:
            yield url
    finally:
        engine.shutdown()


def _lying_prefill() -> FastAPI:
    """A prefill server that stores nothing but promises 16 tokens of KV."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        assert body["kv_transfer_params"] == {"do_remote_decode": True}
        params = {"do_remote_prefill": True, "remote_num_tokens": 16}
        return {"choices": [{"text": "x", "index": 0}], "kv_transfer_params": params}

    @app.get("/health")
    async def health() -> dict:
        return {}

    return app


def _greedy(url: str, prompt: str) -> str:
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0)
    return client(url).completions.create(**kwargs).choices[0].text


def test_a_prefill_answers_with_the_kv_it_stored(kv_url):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    status, _, raw = http(f"{kv_url}/v1/completions", body)
    assert status == 200
    answer = json.loads(raw)
    num_prompt = answer["usage"]["prompt_tokens"]
    assert num_prompt >= 8
    want = {"do_remote_prefill": True, "remote_num_tokens": 8 * (num_prompt // 8)}
    assert answer["kv_transfer_params"] == want
    bad = {**body, "kv_transfer_params": {"remote_block_ids": [1]}}
    status, _, raw = http(f"{kv_url}/v1/completions", bad)
    assert status == 400 and b"remote_block_ids" in raw


def test_the_router_passes_the_params_and_fail_is_honoured(engine_url, kv_url):
    app = build_router_app(BackendPool([kv_url]), BackendPool([kv_url]),
                           pass_kv_transfer_params=True)  # fmt: skip
    with running_server(app) as url:
        assert _greedy(url, PROMPT) == _greedy(engine_url, PROMPT)
    with running_server(_lying_prefill()) as prefill_url:
        app = build_router_app(BackendPool([prefill_url]), BackendPool([kv_url]),
                               pass_kv_transfer_params=True)  # fmt: skip
        with running_server(app) as url:
            fresh = "a prompt no prefill server has stored anywhere at all"
            body = {"model": MODEL, "prompt": fresh, "max_tokens": 4}
            status, _, raw = http(f"{url}/v1/completions", body)
            # streamed: the error is the stream's event (its status was sent before)
            _, _, events = http(f"{url}/v1/completions", {**body, "prompt": fresh + " again",
                                                          "stream": True})  # fmt: skip
    assert status == 500 and b"kv_load_failure_policy" in raw and b"16" in raw
    assert b'"error"' in events and b"kv_load_failure_policy" in events
    # nothing held on the decode server afterwards, and it serves on
    assert _greedy(kv_url, PROMPT) == _greedy(engine_url, PROMPT)


def test_kv_transfer_params_need_a_connector(engine_url):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    status, _, raw = http(f"{engine_url}/v1/completions", body)
    assert status == 400 and b"kv_transfer_params" in raw and b"kv_producer" in raw
