"""load_checkpoint: one entry point from a model name (LLM(model=...)) to a LoadedCheckpoint.

"tiny-random-llama"                 the built-in demo model
a folder with jaxserve_orbax.json   an Orbax checkpoint (jaxserve convert); a folder with
                                    params/ but no marker is an unfinished one: refused
any other folder                    a Hugging Face checkpoint (config.json + safetensors)
"""

from __future__ import annotations

import pathlib

from jaxserve.checkpoints_tools import orbax_checkpoint
from jaxserve.checkpoints_tools.checkpoint import LoadedCheckpoint, ParamSharding, arch_from_config
from jaxserve.checkpoints_tools.hf_loader import load_hf_checkpoint
from jaxserve.checkpoints_tools.tiny_random import (
    TINY_RANDOM_LLAMA,
    make_tiny_random_llama,
    tiny_random_llama_arch,
)
from jaxserve.checkpoints_tools.tokenizer import read_json
from jaxserve.models import ModelArchConfig

BUILTIN_MODELS = (TINY_RANDOM_LLAMA,)


def _folder(model: str | pathlib.Path) -> pathlib.Path:
    if not pathlib.Path(model).is_dir():
        raise FileNotFoundError(
            f"model {str(model)!r} is neither a built-in model {BUILTIN_MODELS} nor a folder"
        )
    return pathlib.Path(model)


def load_checkpoint(
    model: str | pathlib.Path,
    *,
    dtype: str = "auto",
    param_sharding: ParamSharding | None = None,
) -> LoadedCheckpoint:
    """A built-in model by name ("tiny-random-llama"), else an Orbax or Hugging Face folder.

    Raises:
        FileNotFoundError: `model` is neither a built-in name nor an existing folder.
        ValueError / FileNotFoundError: as load_orbax_checkpoint or load_hf_checkpoint.
    """
    if str(model) == TINY_RANDOM_LLAMA:
        return make_tiny_random_llama(dtype=dtype, param_sharding=param_sharding)
    folder = _folder(model)
    if orbax_checkpoint.is_orbax_checkpoint(folder):
        return orbax_checkpoint.load_orbax_checkpoint(
            folder, dtype=dtype, param_sharding=param_sharding
        )
    return load_hf_checkpoint(folder, dtype=dtype, param_sharding=param_sharding)


def load_arch(model: str | pathlib.Path) -> ModelArchConfig:
    """The architecture of what load_checkpoint(model) would load, from its config only (no
    weights read): what a caller needs to plan parameter shardings before loading.

    Raises:
        FileNotFoundError: not a built-in name, a folder, or a folder without config.json.
        ValueError: an unfinished Orbax conversion; a malformed or unsupported config.json.
        TypeError: a config.json value of the wrong type (file and key named).
    """
    if str(model) == TINY_RANDOM_LLAMA:
        return tiny_random_llama_arch()
    folder = _folder(model)
    if orbax_checkpoint.is_orbax_checkpoint(folder):
        orbax_checkpoint.read_marker(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: missing (a checkpoint folder needs it)")
    return arch_from_config(read_json(config_file), config_file)


def declared_dtype(model: str | pathlib.Path) -> str | None:
    """The dtype the checkpoint declares, read without its weights: the dtype an Orbax
    checkpoint was converted to, a Hugging Face config.json's "dtype" / "torch_dtype", float32
    for the built-in model; None when it declares none. (What dtype="auto" starts from.)

    Raises:
        FileNotFoundError / ValueError: as load_arch (call that first for its messages).
    """
    if str(model) == TINY_RANDOM_LLAMA:
        return "float32"
    folder = _folder(model)
    if orbax_checkpoint.is_orbax_checkpoint(folder):
        return orbax_checkpoint.read_marker(folder).get("dtype")
    config = read_json(folder / "config.json")
    value = config.get("dtype", config.get("torch_dtype"))
    return value if isinstance(value, str) else None
