"""Disaggregated serving over the JaxTransferConnector with the real commands: a producer and a
consumer ``jaxserve serve`` (each its own jax.experimental.transfer server on 127.0.0.1, no
shared storage) behind the router, which passes the prefill's kv_transfer_params (the offer) to
the decode: greedy answers identical to one colocated engine, the consumer pulling the prompts'
KV; an offer whose producer was killed before the pull is computed by the consumer, with the
same answer; no block is held on either side afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from server_utils import MODEL, TIMEOUT_S, http, metrics, running_server
from test_disagg_serving import PROMPTS, _greedy, _loaded, _url_of

from jaxserve.fleet.backends import BackendPool
from jaxserve.fleet.disagg import build_router_app


def _serve(role: str) -> tuple[subprocess.Popen, list[str]]:
    kv = {"kv_connector": "JaxTransferConnector", "kv_role": role}
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
    return proc, seen


def _metric(url: str, name: str) -> float:
    return metrics(url)[(f"jaxserve:{name}", ())]


@pytest.mark.slow
def test_the_router_over_the_transfer_connector(engine_url):
    procs = [_serve("kv_producer"), _serve("kv_consumer")]
    try:
        (prod, prod_log), (cons, cons_log) = procs
        prefill_url, decode_url = _url_of(prod, prod_log), _url_of(cons, cons_log)
        app = build_router_app(BackendPool([prefill_url]), BackendPool([decode_url]),
                               pass_kv_transfer_params=True)  # fmt: skip
        with running_server(app) as url:
            for prompt in PROMPTS:
                assert _greedy(url, prompt) == _greedy(engine_url, prompt)
        assert _loaded(decode_url) > 0  # the prompts' KV came from the producer
        assert _metric(decode_url, "kv_connector_load_failures_total") == 0
        # A prefill answered, then its producer killed before the consumer pulls.
        fresh = "a new prompt the consumer has never seen, long enough for blocks"
        body = {"model": MODEL, "prompt": fresh, "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        status, _, raw = http(f"{prefill_url}/v1/completions", body)
        assert status == 200
        params = json.loads(raw)["kv_transfer_params"]
        assert params["remote_num_tokens"] >= 8 and params["remote_host"] == "127.0.0.1"
        assert _metric(prefill_url, "kv_cache_usage_perc") == 0
        prod.send_signal(signal.SIGKILL)
        prod.wait(timeout=TIMEOUT_S)
        loaded = _loaded(decode_url)
        decode = {**body, "max_tokens": 8, "kv_transfer_params": params}
        status, _, raw = http(f"{decode_url}/v1/completions", decode)
        assert status == 200
        assert json.loads(raw)["choices"][0]["text"] == _greedy(engine_url, fresh)
        assert _loaded(decode_url) == loaded  # computed by the consumer itself
        assert _metric(decode_url, "kv_connector_load_failures_total") == 1
        assert _metric(decode_url, "kv_cache_usage_perc") == 0
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=TIMEOUT_S)
