"""load_checkpoint: one entry point from a model name (LLM(model=...)) to a LoadedCheckpoint."""

from __future__ import annotations

import pathlib

from jaxserve.checkpoints_tools.checkpoint import LoadedCheckpoint, ParamSharding
from jaxserve.checkpoints_tools.hf_loader import load_hf_checkpoint
from jaxserve.checkpoints_tools.tiny_random import TINY_RANDOM_LLAMA, make_tiny_random_llama

BUILTIN_MODELS = (TINY_RANDOM_LLAMA,)


def load_checkpoint(
    model: str | pathlib.Path,
    *,
    dtype: str = "auto",
    param_sharding: ParamSharding | None = None,
) -> LoadedCheckpoint:
    """A built-in model by name ("tiny-random-llama"), else a Hugging Face checkpoint folder.

    Raises:
        FileNotFoundError: `model` is neither a built-in name nor an existing folder.
        ValueError / FileNotFoundError: as load_hf_checkpoint.
    """
    if str(model) == TINY_RANDOM_LLAMA:
        return make_tiny_random_llama(dtype=dtype, param_sharding=param_sharding)
    if not pathlib.Path(model).is_dir():
        raise FileNotFoundError(
            f"model {str(model)!r} is neither a built-in model {BUILTIN_MODELS} nor a folder"
        )
    return load_hf_checkpoint(model, dtype=dtype, param_sharding=param_sharding)
