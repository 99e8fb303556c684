"""Disaggregated serving with the real commands: a producer and a consumer ``jaxserve serve``
(--kv-transfer-config, one store folder) behind the router: greedy answers identical to one
colocated engine, the consumer loading the producer's blocks; the producer killed, the router
still answers the same (the consumer computes the prompt)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from server_utils import MODEL, TIMEOUT_S, client, metrics, running_server

from jaxserve.fleet.backends import BackendPool
from jaxserve.fleet.disagg import build_router_app

PROMPTS = ["The capital of France is a city of many bridges and", "1 2 3 4 5 6 7 8 9 10 11"]


def _serve(role: str, store: str) -> tuple[subprocess.Popen, str, list[str]]:
    kv = {"kv_role": role, "kv_connector_extra_config": {"shared_storage_path": store}}
    argv = [
        sys.executable, "-m", "jaxserve.cli", "serve", "--model", "tiny-random-llama",
        "--served-model-name", MODEL, "--port", "0", "--no-warmup", "--block-size", "8",
        "--num-kv-blocks", "64", "--max-model-len", "128", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "64", "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(proc.stderr), daemon=True).start()
    return proc, "", seen


def _url_of(proc: subprocess.Popen, seen: list[str]) -> str:
    deadline = time.monotonic() + TIMEOUT_S * 2
    pattern = re.compile(r"as 'tiny' on (http://127\.0\.0\.1:\d+)/v1")
    while True:
        assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
        for line in list(seen):
            if match := pattern.search(line):
                return match.group(1)
        time.sleep(0.1)


def _greedy(url: str, prompt: str) -> str:
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0)
    return client(url).completions.create(**kwargs).choices[0].text


def _loaded(url: str) -> float:
    return metrics(url)[("jaxserve:kv_connector_loaded_blocks_total", ())]


@pytest.mark.slow
def test_prefill_and_decode_servers_behind_the_router(engine_url, tmp_path):
    procs = [_serve("kv_producer", str(tmp_path)), _serve("kv_consumer", str(tmp_path))]
    try:
        (prod, _, prod_log), (cons, _, cons_log) = procs
        prefill_url, decode_url = _url_of(prod, prod_log), _url_of(cons, cons_log)
        app = build_router_app(BackendPool([prefill_url]), BackendPool([decode_url]))
        with running_server(app) as url:
            for prompt in PROMPTS:
                assert _greedy(url, prompt) == _greedy(engine_url, prompt)
            assert _loaded(decode_url) > 0  # the prompts' blocks came from the producer
            prod.send_signal(signal.SIGKILL)
            prod.wait(timeout=TIMEOUT_S)
            loaded = _loaded(decode_url)
            fresh = "a new prompt no producer has seen, long enough for blocks"
            assert _greedy(url, fresh) == _greedy(engine_url, fresh)
            assert _loaded(decode_url) == loaded  # computed by the consumer itself
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=TIMEOUT_S)
