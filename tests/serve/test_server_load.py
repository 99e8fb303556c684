"""The server under load and with clients that go away: every stream that stays completes, and
every request whose client left is aborted (the engine ends with nothing running, waiting or
held)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from server_utils import (
    MODEL,
    TIMEOUT_S,
    async_client,
    metrics,
    num_aborted,
    wait_engine_idle,
)

from jaxserve.entrypoints.openai.serving import EventStream, OpenAIServing

pytestmark = pytest.mark.slow  # bounded load loops against a live server

NUM_CLIENTS = 64
NUM_LEAVING = 8
# A client that leaves asks for more tokens than it can get before its abort lands (it leaves
# after its first chunk), so each one is counted as aborted, not finished.
LONG = 110


def assert_idle(base_url: str) -> None:
    samples = wait_engine_idle(base_url)
    assert samples[("jaxserve:num_requests_running", ())] == 0
    assert samples[("jaxserve:num_requests_waiting", ())] == 0
    assert samples[("jaxserve:kv_cache_usage_perc", ())] == 0


def test_64_streaming_clients_8_of_which_leave_after_their_first_chunk(base_url):
    aborted_before = num_aborted(base_url)

    async def one(client, i: int):
        leaves = i % (NUM_CLIENTS // NUM_LEAVING) == 0
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Client number {i} asks",
            max_tokens=LONG if leaves else 16,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish_reason, usage = "", None, None
        async for chunk in stream:
            if leaves:
                await stream.close()  # drops the connection
                return None
            if chunk.choices:
                text += chunk.choices[0].text
                finish_reason = chunk.choices[0].finish_reason or finish_reason
            usage = chunk.usage or usage
        return text, finish_reason, usage

    async def main():
        async with async_client(base_url) as client:
            calls = [one(client, i) for i in range(NUM_CLIENTS)]
            return await asyncio.wait_for(asyncio.gather(*calls), TIMEOUT_S)

    results = asyncio.run(main())
    stayed = [r for r in results if r is not None]
    assert len(stayed) == NUM_CLIENTS - NUM_LEAVING
    for _text, finish_reason, usage in stayed:
        assert finish_reason == "length" and usage.completion_tokens == 16
    assert_idle(base_url)
    assert num_aborted(base_url) - aborted_before == NUM_LEAVING


def test_closing_an_event_stream_aborts_its_request(engine, base_url):
    """Without HTTP: what the server does when a client leaves mid-stream."""
    serving = OpenAIServing(engine, MODEL)
    aborted_before = num_aborted(base_url)

    async def main():
        body = {"prompt": "Hello", "stream": True, "max_tokens": LONG, "ignore_eos": True}
        stream = await serving.create_completion(body)
        assert isinstance(stream, EventStream)
        first = await stream.__anext__()
        await stream.aclose()
        return first

    first = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert json.loads(first[len("data: ") :])["object"] == "text_completion"
    assert_idle(base_url)
    assert num_aborted(base_url) - aborted_before == 1


def test_a_client_that_leaves_before_a_non_streamed_answer_aborts_it(base_url):
    aborted_before = num_aborted(base_url)
    body = json.dumps(
        {"model": MODEL, "prompt": "Hello", "max_tokens": LONG, "ignore_eos": True}
    ).encode()
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + TIMEOUT_S
        while metrics(base_url)[("jaxserve:num_requests_running", ())] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    # The socket is closed: the handler is cancelled, which aborts the request.
    assert_idle(base_url)
    assert num_aborted(base_url) - aborted_before == 1
