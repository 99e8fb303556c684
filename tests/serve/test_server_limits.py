"""The server's answers when it cannot serve: 503 with a full waiting queue (max_waiting_requests),
/health 503 and requests refused once the engine is down."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from server_utils import (
    MODEL,
    SMALL,
    TIMEOUT_S,
    async_client,
    http,
    running_server,
    wait_engine_idle,
)

from jaxserve import AsyncLLM
from jaxserve.entrypoints.openai.api_server import build_app

NUM_REQUESTS = 16


@pytest.fixture(scope="module")
def base_url(llm_engine):
    engine = AsyncLLM.from_engine(llm_engine, max_waiting_requests=1, served_model_name=MODEL)
    try:
        with running_server(build_app(engine, served_model_name=MODEL)) as url:
            yield url
    finally:
        engine.shutdown()


def test_requests_beyond_max_waiting_requests_get_503(base_url):
    # At most max_num_seqs (8) run and 1 waits; each asks for 48 tokens, so of 16 sent at
    # once several find the queue full.
    async def one(client, i: int):
        kwargs = dict(
            model=MODEL,
            prompt=f"Request {i}",
            max_tokens=48,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        try:
            if i % 2:
                out = await client.completions.create(**kwargs)
                return out.choices[0].finish_reason
            stream = await client.completions.create(stream=True, **kwargs)
            return [c.choices[0].finish_reason async for c in stream][-1]
        except openai.APIStatusError as e:
            return e.status_code, e.body

    async def main():
        async with async_client(base_url) as client:
            calls = [one(client, i) for i in range(NUM_REQUESTS)]
            return await asyncio.wait_for(asyncio.gather(*calls), TIMEOUT_S)

    results = asyncio.run(main())
    refused = [r for r in results if isinstance(r, tuple)]
    served = [r for r in results if not isinstance(r, tuple)]
    assert refused and served
    for status, error in refused:
        assert status == 503 and error["type"] == "ServiceUnavailableError"
        assert "max_waiting_requests=1" in error["message"]
    assert all(finish_reason == "length" for finish_reason in served)
    samples = wait_engine_idle(base_url)
    assert samples[("jaxserve:num_requests_running", ())] == 0


def test_health_is_503_and_requests_fail_once_the_engine_is_down():
    engine = AsyncLLM("tiny-random-llama", **SMALL)  # runs no step: nothing to compile
    with running_server(build_app(engine, served_model_name=MODEL)) as url:
        assert http(url + "/health")[0] == 200
        engine.shutdown()
        status, _, raw = http(url + "/health")
        assert status == 503 and json.loads(raw)["error"]["type"] == "ServiceUnavailableError"
        status, _, raw = http(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        error = json.loads(raw)["error"]
        assert status == 500 and "not running" in error["message"]


def test_a_failed_engine_step_is_a_500_or_an_error_event_and_the_server_serves_on(
    base_url, llm_engine, monkeypatch
):
    runner = llm_engine.runner
    real = runner.dispatch
    calls = {"n": 0, "fail_at": 3}  # the stream has begun (its first token came from call 1)

    def flaky(scheduler_output, trace=None):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("device lost")
        return real(scheduler_output, trace)

    monkeypatch.setattr(runner, "dispatch", flaky)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 20, "ignore_eos": True}
    status, headers, raw = http(base_url + "/v1/completions", {**body, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert len(events) >= 3 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "device lost" in error["message"]
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-2])

    calls.update(n=0, fail_at=1)
    status, _, raw = http(base_url + "/v1/completions", body)
    error = json.loads(raw)["error"]
    assert status == 500 and error["type"] == "InternalServerError"
    assert "device lost" in error["message"]

    calls.update(n=0, fail_at=-1)
    status, _, raw = http(base_url + "/v1/completions", body)
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 20
