"""Fixtures of the server tests: one LLMEngine per test process, which each module drives with
an AsyncLLM of its own (AsyncLLM.from_engine), so the XLA compilations of its batch shapes are
paid once per process. pytest finishes a module's fixtures before the next module's start, so
only one AsyncLLM drives the engine at a time."""

from __future__ import annotations

import pytest
from server_utils import MODEL, SMALL, running_server

from jaxserve import AsyncLLM, LLMEngine
from jaxserve.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="session")
def llm_engine() -> LLMEngine:
    return LLMEngine("tiny-random-llama", **SMALL)


@pytest.fixture(scope="module")
def engine(llm_engine):
    """The module's AsyncLLM over the session's engine (a module may define its own)."""
    engine = AsyncLLM.from_engine(llm_engine, served_model_name=MODEL)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def base_url(engine):
    """A server on 127.0.0.1 over the module's engine, for the module's tests."""
    with running_server(build_app(engine, served_model_name=MODEL)) as url:
        yield url
