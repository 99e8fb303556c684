"""Checkpoint loading: Hugging Face folders (config.json + safetensors), jaxserve Orbax folders
(and the conversion between them), tokenizers, and the built-in demo model. `testing` (tiny HF
checkpoints written by transformers) is imported explicitly by tests and benchmarks only.

The names below are exported lazily (a module-level __getattr__), so that importing a light
submodule, as `python -m jaxserve.checkpoints_tools.convert` and `jaxserve convert` do, does
not import jax first: the conversion must install its Ctrl-C handler before that import
(interrupt.py says why). Running the module also no longer finds it imported already by this
package, which made runpy warn.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "DTYPE_NAMES": "jaxserve.checkpoints_tools.checkpoint",
    "LoadedCheckpoint": "jaxserve.checkpoints_tools.checkpoint",
    "ParamSharding": "jaxserve.checkpoints_tools.checkpoint",
    "resolve_dtype": "jaxserve.checkpoints_tools.checkpoint",
    "convert_hf_to_orbax": "jaxserve.checkpoints_tools.convert",
    "load_hf_checkpoint": "jaxserve.checkpoints_tools.hf_loader",
    "load_arch": "jaxserve.checkpoints_tools.load",
    "load_checkpoint": "jaxserve.checkpoints_tools.load",
    "load_orbax_checkpoint": "jaxserve.checkpoints_tools.orbax_checkpoint",
    "TINY_RANDOM_LLAMA": "jaxserve.checkpoints_tools.tiny_random",
    "build_tiny_tokenizer": "jaxserve.checkpoints_tools.tiny_random",
    "make_tiny_random_llama": "jaxserve.checkpoints_tools.tiny_random",
    "TokenizerInfo": "jaxserve.checkpoints_tools.tokenizer",
    "load_tokenizer": "jaxserve.checkpoints_tools.tokenizer",
}

__all__ = [  # spelled out so linters see the TYPE_CHECKING imports used
    "DTYPE_NAMES",
    "TINY_RANDOM_LLAMA",
    "LoadedCheckpoint",
    "ParamSharding",
    "TokenizerInfo",
    "build_tiny_tokenizer",
    "convert_hf_to_orbax",
    "load_arch",
    "load_checkpoint",
    "load_hf_checkpoint",
    "load_orbax_checkpoint",
    "load_tokenizer",
    "make_tiny_random_llama",
    "resolve_dtype",
]

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.checkpoints_tools.checkpoint import (
        DTYPE_NAMES,
        LoadedCheckpoint,
        ParamSharding,
        resolve_dtype,
    )
    from jaxserve.checkpoints_tools.convert import convert_hf_to_orbax
    from jaxserve.checkpoints_tools.hf_loader import load_hf_checkpoint
    from jaxserve.checkpoints_tools.load import load_arch, load_checkpoint
    from jaxserve.checkpoints_tools.orbax_checkpoint import load_orbax_checkpoint
    from jaxserve.checkpoints_tools.tiny_random import (
        TINY_RANDOM_LLAMA,
        build_tiny_tokenizer,
        make_tiny_random_llama,
    )
    from jaxserve.checkpoints_tools.tokenizer import TokenizerInfo, load_tokenizer


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxserve.checkpoints_tools' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
