"""load_checkpoint: one entry point from a model name (LLM(model=...)) to a LoadedCheckpoint.

A model name is tried as, in this order:

"tiny-random-llama"                 the built-in demo model
a folder with jaxserve_orbax.json   an Orbax checkpoint (jaxserve convert); a folder with
                                    params/ but no marker is an unfinished one: refused
any other folder                    a Hugging Face checkpoint (config.json + safetensors)
"org/name" or "name", no such path  a Hugging Face Hub model ID: its snapshot in the Hugging
                                    Face cache, fetched when missing (hub.py), then as a folder

A name that is none of these gets one FileNotFoundError naming the three things tried.
`revision` and `download_dir` apply to Hub model IDs only: given with a built-in name or a
folder they raise ValueError (they would otherwise be ignored).
"""

from __future__ import annotations

import os
import pathlib

from jaxserve.checkpoints_tools import hub, orbax_checkpoint
from jaxserve.checkpoints_tools.checkpoint import LoadedCheckpoint, ParamSharding, arch_from_config
from jaxserve.checkpoints_tools.hf_loader import config_dtype, load_hf_checkpoint
from jaxserve.checkpoints_tools.quantization import (
    CheckpointQuantization,
    read_quantization_config,
)
from jaxserve.checkpoints_tools.tiny_random import (
    TINY_RANDOM_LLAMA,
    make_tiny_random_llama,
    tiny_random_llama_arch,
)
from jaxserve.checkpoints_tools.tokenizer import read_json
from jaxserve.models import ModelArchConfig

BUILTIN_MODELS = (TINY_RANDOM_LLAMA,)


def resolve_model(
    model: str | pathlib.Path,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike[str] | None = None,
    files: tuple[str, ...] = hub.CHECKPOINT_FILES,
) -> str:
    """Where `model` is: a built-in name (returned as is), an existing folder (returned as
    is), else a Hub model ID, returned as the path of its local snapshot folder (the files
    matching `files` fetched when the cache lacks them, unless HF_HUB_OFFLINE is set).

    A pathlib.Path is always a path, never a Hub ID. Resolving a result again returns it
    unchanged (it is a built-in name or an existing folder), without touching the Hub.

    Args:
        revision: the Hub branch, tag or commit (None: "main"); Hub model IDs only.
        download_dir: the Hugging Face cache folder (None: HF_HUB_CACHE / HF_HOME's); Hub model
            IDs only.
        files: glob patterns of the snapshot files to fetch (hub.CONFIG_FILES: config.json
            only, for planning).

    Raises:
        FileNotFoundError: neither a built-in model, an existing folder nor a Hub model that
            could be resolved (all three named; for a Hub ID, why: offline without a cached
            snapshot, no such repository or revision, ...); an existing file, not a folder.
        ValueError: revision or download_dir given for a built-in model or a folder.
    """
    name = str(model)
    if name in BUILTIN_MODELS or pathlib.Path(name).is_dir():
        _refuse_hub_arguments(name, revision=revision, download_dir=download_dir)
        return name
    tried = f"model {name!r} is neither a built-in model {BUILTIN_MODELS}, nor an existing folder"
    if pathlib.Path(name).exists():
        raise FileNotFoundError(f"{tried} (it is a file), nor a Hugging Face Hub model ID")
    if isinstance(model, pathlib.Path) or not hub.is_hub_id(name):
        raise FileNotFoundError(
            f"{tried}, nor a Hugging Face Hub model ID ('org/name'): no such folder"
        )
    try:
        folder = hub.hub_snapshot(
            name, revision=revision, download_dir=download_dir, allow_patterns=files
        )
    except hub.HubUnavailableError as e:
        raise FileNotFoundError(
            f"{tried}, nor a Hugging Face Hub model that resolves: {e}"
        ) from None
    return str(folder)


def _refuse_hub_arguments(name: str, **arguments: object) -> None:
    """Refuse Hub-only arguments for a built-in model or a folder, where they cannot apply."""
    given = {k: v for k, v in arguments.items() if v is not None}
    if given:
        what = "a built-in model" if name in BUILTIN_MODELS else "a local folder"
        settings = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(
            f"{settings}: applies to Hugging Face Hub model IDs only, and model {name!r} is {what}"
        )


def _folder(model: str | pathlib.Path, **hub_arguments: object) -> pathlib.Path:
    """The folder of a model that is not built in (see resolve_model)."""
    return pathlib.Path(resolve_model(model, **hub_arguments))


def load_checkpoint(
    model: str | pathlib.Path,
    *,
    dtype: str = "auto",
    param_sharding: ParamSharding | None = None,
    revision: str | None = None,
    download_dir: str | os.PathLike[str] | None = None,
    quantization: str | None = None,
) -> LoadedCheckpoint:
    """A built-in model by name ("tiny-random-llama"), else an Orbax or Hugging Face folder,
    else a Hugging Face Hub model ID (see resolve_model).

    Args:
        quantization: None, "int8" or "fp8" (load_hf_checkpoint); the built-in model's random
            weights are quantized after they are drawn; an Orbax folder's must be its own
            (load_orbax_checkpoint).

    Raises:
        FileNotFoundError: `model` is neither a built-in name, an existing folder nor a Hub
            model ID that resolves (see resolve_model).
        ValueError: revision / download_dir for a built-in model or a folder.
        ValueError / FileNotFoundError: as load_orbax_checkpoint or load_hf_checkpoint.
    """
    if str(model) == TINY_RANDOM_LLAMA:
        _refuse_hub_arguments(TINY_RANDOM_LLAMA, revision=revision, download_dir=download_dir)
        return make_tiny_random_llama(
            dtype=dtype, param_sharding=param_sharding, quantization=quantization
        )
    folder = _folder(model, revision=revision, download_dir=download_dir)
    if orbax_checkpoint.is_orbax_checkpoint(folder):
        return orbax_checkpoint.load_orbax_checkpoint(
            folder, dtype=dtype, param_sharding=param_sharding, quantization=quantization
        )
    return load_hf_checkpoint(
        folder, dtype=dtype, param_sharding=param_sharding, quantization=quantization
    )


def load_arch(
    model: str | pathlib.Path,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike[str] | None = None,
) -> ModelArchConfig:
    """The architecture of what load_checkpoint(model) would load, from its config only (no
    weights read; of a Hub model ID only config.json is fetched): what a caller needs to plan
    parameter shardings and memory before loading.

    Raises:
        FileNotFoundError: not a built-in name, a folder or a Hub model ID that resolves, or a
            folder without config.json.
        ValueError: an unfinished Orbax conversion; a malformed or unsupported config.json;
            revision / download_dir for a built-in model or a folder.
        TypeError: a config.json value of the wrong type (file and key named).
    """
    if str(model) == TINY_RANDOM_LLAMA:
        _refuse_hub_arguments(TINY_RANDOM_LLAMA, revision=revision, download_dir=download_dir)
        return tiny_random_llama_arch()
    folder = _folder(model, revision=revision, download_dir=download_dir, files=hub.CONFIG_FILES)
    if orbax_checkpoint.is_orbax_checkpoint(folder):
        orbax_checkpoint.read_marker(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: missing (a checkpoint folder needs it)")
    return arch_from_config(read_json(config_file), config_file)


def declared_dtype(
    model: str | pathlib.Path,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike[str] | None = None,
) -> str | None:
    """The dtype the checkpoint declares, read without its weights: the dtype an Orbax
    checkpoint was converted to, a Hugging Face config.json's "dtype" / "torch_dtype", float32
    for the built-in model; None when it declares none. (What dtype="auto" starts from.)

    Raises:
        FileNotFoundError / ValueError: as load_arch (call that first for its messages).
    """
    if str(model) == TINY_RANDOM_LLAMA:
        _refuse_hub_arguments(TINY_RANDOM_LLAMA, revision=revision, download_dir=download_dir)
        return "float32"
    folder = _folder(model, revision=revision, download_dir=download_dir, files=hub.CONFIG_FILES)
    if orbax_checkpoint.is_orbax_checkpoint(folder):
        return orbax_checkpoint.read_marker(folder).get("dtype")
    value = config_dtype(read_json(folder / "config.json"), folder / "config.json")
    return value if isinstance(value, str) else None


def declared_quantization(
    model: str | pathlib.Path,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike[str] | None = None,
) -> CheckpointQuantization | None:
    """The 8-bit format a checkpoint declares, read without its weights: a Hugging Face
    config.json's quantization_config, an Orbax folder's marker; None for a float checkpoint
    and the built-in model.

    Raises:
        ValueError: a quantization_config the engine cannot honour (key named).
        FileNotFoundError / ValueError: as load_arch (call that first for its messages).
    """
    if str(model) == TINY_RANDOM_LLAMA:
        return None
    folder = _folder(model, revision=revision, download_dir=download_dir, files=hub.CONFIG_FILES)
    if orbax_checkpoint.is_orbax_checkpoint(folder):
        stored = orbax_checkpoint.read_marker(folder).get("quantization")
        marker = f"{orbax_checkpoint.MARKER_FILE}: quantization={stored!r}"
        return None if stored is None else CheckpointQuantization(stored, marker)
    return read_quantization_config(read_json(folder / "config.json"))
