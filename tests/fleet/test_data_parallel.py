"""``jaxserve serve --data-parallel-size 2``, the real command: two replica processes (each on
its own core here) behind one endpoint; greedy answers identical to one engine's; /metrics
per replica and summed; SIGTERM stops the front and both replicas, exit 0; bad flags exit 2."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from server_utils import MODEL, TIMEOUT_S, client, http, metrics

from jaxserve import cli

PROMPTS = ["The capital of France is", "1 2 3 4 5", "a b a b a b a b", "hello " * 12]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--data-parallel-size", "0"], "--data-parallel-size"),
        (["--data-parallel-size", "2", "--routing", "random"], "--routing"),
    ],
)
def test_bad_data_parallel_flags_exit_2(capsys, argv, says):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--model", "m", *argv])
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_replicas_get_the_engine_flags_and_not_the_fronts():
    from jaxserve.cli.serve import replica_args

    args = cli.build_parser().parse_args(
        ["serve", "--model", "m", "--api-key", "k", "--port", "9", "--data-parallel-size", "2",
         "--block-size", "8", "--no-warmup", "--speculative-config", '{"method": "ngram"}']
    )  # fmt: skip
    argv = replica_args(args)
    assert argv[:4] == ["--model", "m", "--served-model-name", "m"]
    for absent in ("--api-key", "--port", "--data-parallel-size", "--routing", "--host"):
        assert absent not in argv
    assert argv[argv.index("--block-size") + 1] == "8" and "--no-warmup" in argv
    assert argv[argv.index("--speculative-config") + 1] == '{"method": "ngram"}'


def _two_free_ports() -> int:
    """A port P with P + 1 free too (bounded tries)."""
    import socket

    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise AssertionError("no two consecutive free ports")


def test_each_replica_gets_its_own_kv_transfer_port():
    """A fixed transfer_port would be taken by every replica: replica i gets base + i (and
    both servers start), port 0 stays 0 (each replica a free port), past 65535 is refused."""
    import json

    import jax.numpy as jnp

    from jaxserve.cli.serve import replica_args
    from jaxserve.fleet.replicas import replica_serve_args
    from jaxserve.kv_transfer_config import KVTransferConfig
    from jaxserve.runner.kv_transfer_worker import make_transfer_connector

    def argv_for(port: int) -> list[str]:
        kv = {"kv_connector": "JaxTransferConnector", "kv_role": "kv_producer",
              "kv_connector_extra_config": {"transfer_port": port, "lease_s": 9}}  # fmt: skip
        args = cli.build_parser().parse_args(
            ["serve", "--model", "m", "--data-parallel-size", "2", "--kv-transfer-config",
             json.dumps(kv)]
        )  # fmt: skip
        return replica_args(args)

    def config_of(argv: list[str]) -> dict:
        return json.loads(argv[argv.index("--kv-transfer-config") + 1])

    base = _two_free_ports()
    configs = [config_of(replica_serve_args(argv_for(base), i, 2)) for i in range(2)]
    extras = [c["kv_connector_extra_config"] for c in configs]
    assert extras == [{"transfer_port": base, "lease_s": 9},
                      {"transfer_port": base + 1, "lease_s": 9}]  # fmt: skip
    workers = [make_transfer_connector(KVTransferConfig.from_value(c), "m", 1, (1, 4, 4, 8),
                                       jnp.float32, None) for c in configs]  # fmt: skip
    assert [w.connector.port for w in workers] == [base, base + 1]
    for i in range(2):
        assert config_of(replica_serve_args(argv_for(0), i, 2)) == config_of(argv_for(0))
    assert replica_serve_args(["--model", "m"], 1, 2) == ["--model", "m"]
    with pytest.raises(ValueError, match="transfer_port=65535"):
        replica_serve_args(argv_for(65535), 0, 2)


@pytest.mark.slow
def test_two_replicas_answer_as_one_engine_and_stop_on_sigterm(engine_url):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv = [
        sys.executable, "-m", "jaxserve.cli", "serve", "--model", "tiny-random-llama",
        "--served-model-name", MODEL, "--port", "0", "--no-warmup", "--block-size", "8",
        "--num-kv-blocks", "64", "--max-model-len", "128", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "64", "--data-parallel-size", "2", "--routing", "prefix",
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []  # every line, read all along: the replicas log to the same pipe
    threading.Thread(target=lambda: seen.extend(proc.stderr), daemon=True).start()
    try:
        url = _wait_for_front(proc, seen)
        for prompt in PROMPTS:
            kwargs = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0)
            want = client(engine_url).completions.create(**kwargs).choices[0].text
            assert client(url).completions.create(**kwargs).choices[0].text == want
        samples = metrics(url)
        name, length = "jaxserve:request_success_total", ("finished_reason", "length")
        per = [samples.get((name, (length, ("replica", r))), 0.0) for r in "01"]
        assert sum(per) == samples[(name, (length,))] == len(PROMPTS)
        assert http(f"{url}/health")[0] == 200
        replica_pids = _children(proc.pid)
        assert len(replica_pids) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT_S) == 0
        assert not [pid for pid in replica_pids if _alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT_S)


def _wait_for_front(proc: subprocess.Popen, seen: list[str]) -> str:
    deadline = time.monotonic() + TIMEOUT_S * 2
    pattern = re.compile(r"serving 2 replicas \(routing prefix\) on (http://127\.0\.0\.1:\d+)/v1")
    while True:
        assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
        for line in list(seen):
            if match := pattern.search(line):
                return match.group(1)
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
