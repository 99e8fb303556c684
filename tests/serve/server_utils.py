"""Shared helpers of the server tests: the small engine configuration, a uvicorn server in a
background thread on 127.0.0.1, raw HTTP requests and reading /metrics."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

SMALL = dict(
    block_size=8,
    num_kv_blocks=64,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    warmup=False,
)
MODEL = "tiny"  # the served model name of the test servers
TIMEOUT_S = 120  # bound of any one client call or load loop (never asserted)


@contextlib.contextmanager
def running_server(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1 (a free port) in a background thread; yields
    the base URL and stops the server afterwards."""
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def client(base_url: str, api_key: str = "unused", **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=TIMEOUT_S, **kwargs
    )


def async_client(base_url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=TIMEOUT_S
    )


def http(
    url: str,
    body: bytes | dict | None = None,
    headers: dict[str, str] | None = None,
    method: str | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP request: (status, headers, body), whatever the status."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def metrics(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of /metrics: (name, sorted labels without model_name) -> value."""
    status, _, body = http(f"{base_url}/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def num_aborted(base_url: str) -> float:
    key = ("jaxserve:request_success_total", (("finished_reason", "abort"),))
    return metrics(base_url).get(key, 0.0)


def wait_engine_idle(base_url: str) -> dict:
    """Poll /metrics (bounded) until nothing runs, waits or holds KV blocks; aborts land on
    the engine thread's next pass. Returns the last samples read."""
    deadline = time.monotonic() + TIMEOUT_S
    names = (
        "jaxserve:num_requests_running",
        "jaxserve:num_requests_waiting",
        "jaxserve:kv_cache_usage_perc",
    )
    while True:
        samples = metrics(base_url)
        if all(samples[(n, ())] == 0 for n in names) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)
