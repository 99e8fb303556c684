"""Fixtures of the server tests: one LLMEngine per test process, which each module drives with
an AsyncLLM of its own (AsyncLLM.from_engine), so the XLA compilations of its batch shapes are
paid once per process. pytest finishes a module's fixtures before the next module's start, so
only one AsyncLLM drives the engine at a time."""

from __future__ import annotations

import pytest
from server_utils import SMALL

from jaxserve import LLMEngine


@pytest.fixture(scope="session")
def llm_engine() -> LLMEngine:
    return LLMEngine("tiny-random-llama", **SMALL)
