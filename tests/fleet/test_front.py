"""The data-parallel front (proxy.py) over real engine servers (one server, reached as both
backends): greedy answers identical to the engine's own, streamed and whole; a client that
leaves mid-stream or before its answer frees every block; /metrics per backend and summed;
an unreachable backend is skipped; the API key and the body limit are the front's."""

from __future__ import annotations

import asyncio
import socket

import pytest
from server_utils import (
    MODEL,
    client,
    http,
    metrics,
    num_aborted,
    running_server,
    wait_engine_idle,
)

from jaxserve.fleet.backends import BackendPool
from jaxserve.fleet.proxy import FrontSettings, build_front_app
from jaxserve.fleet.routing import PrefixAware, RoundRobin

PROMPTS = ["The capital of France is", "1 2 3 4 5", "a b a b a b a b"]


@pytest.fixture(scope="module")
def front_url(engine_url):
    pool = BackendPool([engine_url, engine_url], interval_s=0.1)
    with running_server(build_front_app(pool, PrefixAware(2))) as url:
        yield url


def _greedy(base_url: str, prompt: str, stream: bool = False) -> str:
    c = client(base_url)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0)
    if not stream:
        return c.completions.create(**kwargs).choices[0].text
    return "".join(chunk.choices[0].text for chunk in c.completions.create(stream=True, **kwargs))


def test_greedy_answers_are_the_engines_own(engine_url, front_url):
    for prompt in PROMPTS:
        direct = _greedy(engine_url, prompt)
        assert _greedy(front_url, prompt) == direct
        assert _greedy(front_url, prompt, stream=True) == direct
    chat = client(front_url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].finish_reason == "length"
    assert b'"data"' in http(f"{front_url}/v1/models")[2]


def test_a_client_that_leaves_frees_every_block(engine_url, front_url):
    body = {"model": MODEL, "prompt": "x y", "max_tokens": 100}
    aborted = num_aborted(engine_url)
    stream = client(front_url).completions.create(
        stream=True, extra_body={"min_tokens": 100}, **body
    )
    next(iter(stream))  # the first chunk arrived: the request is running there
    stream.close()
    asyncio.run(_leave_once_running(engine_url, front_url, {**body, "min_tokens": 100}))
    samples = wait_engine_idle(engine_url)
    # The streamed request is cut for sure; the other one unless it finished first (a timing
    # this test does not control): at least one abort, and nothing held either way.
    assert num_aborted(engine_url) >= aborted + 1
    assert samples[("jaxserve:num_requests_running", ())] == 0
    assert samples[("jaxserve:kv_cache_usage_perc", ())] == 0
    front = metrics(front_url)
    in_flight = [v for (name, _), v in front.items() if name == "jaxserve:front_requests_in_flight"]
    assert in_flight == [0, 0]


async def _leave_once_running(engine_url: str, front_url: str, body: dict) -> None:
    """A non-streaming request whose client leaves once the engine runs it."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        task = asyncio.ensure_future(session.post(f"{front_url}/v1/completions", json=body))
        for _ in range(500):  # bounded: 10 s
            running = await asyncio.to_thread(metrics, engine_url)
            if running[("jaxserve:num_requests_running", ())] >= 1 or task.done():
                break
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_metrics_are_labelled_per_replica_and_summed(front_url):
    samples = metrics(front_url)
    name, length = "jaxserve:request_success_total", ("finished_reason", "length")
    per = [samples[(name, (length, ("replica", r)))] for r in "01"]
    total = samples[(name, (length,))]
    assert total == sum(per) and total > 0  # one engine reached twice: twice its count
    routed = [samples[("jaxserve:front_requests_routed_total", (("replica", r),))] for r in "01"]
    assert sum(routed) >= 2 * len(PROMPTS) + 1


def test_an_unreachable_backend_is_skipped(engine_url):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    pool = BackendPool([dead, engine_url], interval_s=0.1)
    with running_server(build_front_app(pool, RoundRobin())) as url:
        assert http(f"{url}/health")[0] == 503
        for prompt in PROMPTS:  # round-robin would pick the dead one every other time
            assert _greedy(url, prompt) == _greedy(engine_url, prompt)


def test_the_key_and_the_body_limit_are_the_fronts(engine_url):
    pool = BackendPool([engine_url])
    settings = FrontSettings(api_key="k", max_body_bytes=1000)
    with running_server(build_front_app(pool, RoundRobin(), settings)) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        assert http(f"{url}/v1/completions", body)[0] == 401
        auth = {"Authorization": "Bearer k"}
        assert http(f"{url}/v1/completions", body, auth)[0] == 200
        assert http(f"{url}/v1/completions", {**body, "prompt": "x" * 2000}, auth)[0] == 413
        status, _, answer = http(f"{url}/v1/completions", {**body, "max_tokens": -1}, auth)
        assert status == 400 and b"max_tokens" in answer  # the engine's own error, passed on
        assert http(f"{url}/health")[0] == 200 and http(f"{url}/metrics")[0] == 200
