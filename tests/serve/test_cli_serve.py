"""``jaxserve serve``: its flags, bad flags (exit 2), and one run of the real command: it
listens, answers /health and /v1/models with the API key from the environment, and shuts down
cleanly on SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from server_utils import TIMEOUT_S, http

from jaxserve import cli


def test_help_lists_the_server_and_engine_flags(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--model",
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--max-waiting-requests",
        "--max-model-len",
        "--no-warmup",
        "--num-kv-blocks",
        "--seed",
    ):
        assert flag in out
    assert "serve" in cli.build_parser().format_help()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "--model"),
        (["--model", "m", "--port", "http"], "--port"),
        (["--model", "m", "--port", "70000"], "--port"),
        (["--model", "m", "--max-waiting-requests", "0"], "--max-waiting-requests"),
        (["--model", "m", "--max-model-len", "long"], "--max-model-len"),
        (["--model", "m", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_flags_exit_with_code_2(capsys, argv, says):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", *argv])
    assert info.value.code == 2
    assert says in capsys.readouterr().err


@pytest.fixture
def jaxserve_logger():
    """`jaxserve serve` gives the jaxserve logger a handler: take it away after the test."""
    logger = logging.getLogger("jaxserve")
    handlers, level = list(logger.handlers), logger.level
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


def test_a_model_that_cannot_be_found_exits_with_code_2(capsys, tmp_path, jaxserve_logger):
    missing = str(tmp_path / "no-model-here")
    assert cli.main(["serve", "--model", missing, "--port", "0", "--no-warmup"]) == 2
    assert "jaxserve serve: error:" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_jaxserve_serve_listens_answers_and_stops_on_a_signal(stop):
    env = {**os.environ, "JAXSERVE_API_KEY": "env-key", "JAX_PLATFORMS": "cpu"}
    argv = [
        sys.executable, "-m", "jaxserve.cli", "serve", "--model", "tiny-random-llama",
        "--served-model-name", "tiny", "--port", "0", "--no-warmup", "--block-size", "8",
        "--num-kv-blocks", "16", "--max-model-len", "64", "--max-num-seqs", "2",
        "--max-num-batched-tokens", "32", "--uvicorn-log-level", "info",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    seen = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        port = None
        while port is None:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                continue
            match = re.search(r"running on http://127\.0\.0\.1:(\d+)", seen[-1])
            port = int(match.group(1)) if match else None
        assert any("serving 'tiny-random-llama' as 'tiny'" in line for line in seen), seen
        url = f"http://127.0.0.1:{port}"
        assert http(url + "/health")[0] == 200
        assert http(url + "/v1/models")[0] == 401
        status, _, body = http(url + "/v1/models", headers={"Authorization": "Bearer env-key"})
        assert status == 200 and b'"tiny"' in body
        proc.send_signal(stop)
        assert proc.wait(timeout=TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT_S)
