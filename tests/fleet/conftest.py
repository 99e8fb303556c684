"""Fixtures of the fleet tests: one real engine server on 127.0.0.1 (the server tests' small
configuration) for the session, which the fronts under test reach as every one of their
backends: a front's forwarding, streaming and aborts are tested against a real engine at the
price of one.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

# The server tests' helpers (a uvicorn server in a thread, raw HTTP, /metrics samples).
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "serve"))

from server_utils import MODEL, SMALL, running_server  # noqa: E402

from jaxserve import AsyncLLM  # noqa: E402
from jaxserve.entrypoints.openai.api_server import build_app  # noqa: E402


@pytest.fixture(scope="session")
def engine_url():
    """A real engine server, for the session's fleet tests."""
    engine = AsyncLLM(model="tiny-random-llama", served_model_name=MODEL, **SMALL)
    try:
        with running_server(build_app(engine, served_model_name=MODEL)) as url:
            yield url
    finally:
        engine.shutdown()
