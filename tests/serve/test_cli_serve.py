"""``jaxserve serve``: its flags, bad flags (exit 2), and one run of the real command: it
listens, answers /health and /v1/models with the API key from the environment, and shuts down
cleanly on SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import os
import queue
import re
import signal
import socket
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
            match = re.search(
                r"serving 'tiny-random-llama' as 'tiny' on http://127\.0\.0\.1:(\d+)/v1", seen[-1]
            )
            port = int(match.group(1)) if match else None
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


@pytest.mark.parametrize("where", ["flag", "env"])
def test_an_empty_api_key_is_refused_before_anything_loads(
    where, capsys, monkeypatch, jaxserve_logger
):
    """An unset shell variable (--api-key "$KEY") must not start a server open to anyone."""
    from jaxserve.entrypoints.openai import api_server

    monkeypatch.setattr(api_server, "AsyncLLM", _must_not_build)
    argv = ["serve", "--model", "tiny-random-llama", "--port", "0"]
    if where == "flag":
        argv += ["--api-key", ""]
    else:
        monkeypatch.setenv(api_server.API_KEY_ENV, " ")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert ("--api-key is empty" if where == "flag" else "is set but empty") in err


def test_a_port_in_use_exits_2_naming_it_before_the_engine_is_built(
    capsys, monkeypatch, jaxserve_logger
):
    from jaxserve.entrypoints.openai import api_server

    monkeypatch.setattr(api_server, "AsyncLLM", _must_not_build)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--model", "tiny-random-llama", "--port", str(port)]
        assert cli.main([*argv, "--host", "127.0.0.1"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_no_key_on_an_address_other_machines_reach_is_warned_about(
    caplog, monkeypatch, jaxserve_logger
):
    """Checked with the bind refused, so that the test itself listens on nothing but loopback."""
    from jaxserve.entrypoints.openai import api_server

    def refuse(host, port):
        raise OSError(98, f"cannot listen on {host}:{port}: (test)")

    monkeypatch.setattr(api_server, "bind_socket", refuse)
    monkeypatch.delenv(api_server.API_KEY_ENV, raising=False)
    argv = ["serve", "--model", "tiny-random-llama", "--port", "8000"]
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert cli.main([*argv, "--host", "0.0.0.0"]) == 2
        assert cli.main([*argv, "--host", "0.0.0.0", "--api-key", "k"]) == 2
        assert cli.main([*argv, "--host", "::1"]) == 2
    warned = [r.getMessage() for r in caplog.records if "no API key" in r.getMessage()]
    assert len(warned) == 1 and "0.0.0.0" in warned[0]


def _must_not_build(*args, **kwargs):
    raise AssertionError("the engine was built")


@pytest.mark.slow
def test_ctrl_c_while_the_engine_warms_up_exits_130_with_one_line():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv = [
        sys.executable, "-m", "jaxserve.cli", "serve", "--model", "tiny-random-llama",
        "--port", "0", "--max-model-len", "256", "--uvicorn-log-level", "info",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        seen = []
        while not any("memory plan" in line for line in seen):  # warm-up comes next
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
            seen.append(proc.stderr.readline())
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=TIMEOUT_S)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT_S)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.rstrip().endswith("jaxserve serve: interrupted"), err
    assert not any("serving 'tiny-random-llama'" in line for line in seen + [err])
