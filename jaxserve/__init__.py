"""jaxserve: a vLLM-style LLM inference engine for JAX/XLA.

The public API is exported lazily (module-level ``__getattr__``) so that ``import jaxserve.core``
and the plain data modules never load jax (docs/architecture.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "jaxserve.engine.llm",
    "LLMEngine": "jaxserve.engine.llm_engine",
    "AsyncLLM": "jaxserve.engine.async_llm",
    "RequestOutputKind": "jaxserve.sampling_params",
    "SamplingParams": "jaxserve.sampling_params",
    "StructuredOutputsParams": "jaxserve.sampling_params",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "Logprob": "jaxserve.outputs",
}

__all__ = [  # spelled out (not sorted(_LAZY)) so linters see the TYPE_CHECKING imports used
    "AsyncLLM",
    "CompletionOutput",
    "LLM",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.engine.llm import LLM
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
    from jaxserve.sampling_params import (
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
