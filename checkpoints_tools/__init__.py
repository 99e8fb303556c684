"""Checkpoint loading: Hugging Face folders (config.json + safetensors), jaxserve Orbax folders
(and the conversion between them), tokenizers, and the built-in demo model. `testing` (tiny HF
checkpoints written by transformers) is imported explicitly by tests and benchmarks only."""

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

__all__ = [
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
