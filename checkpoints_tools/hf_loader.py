"""Load a Hugging Face checkpoint folder (config.json + safetensors) into jaxserve params.

Loading is lazy and checked up front: first every safetensors header is read (names, shapes;
no data) and checked against what the architecture needs, so a bad checkpoint fails before
anything is allocated; then tensors are read one at a time, converted (cast, transposed,
reshaped) and placed on device before the next is read, so host memory holds at most one
tensor, never a second copy of the model.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from safetensors import safe_open

from jaxserve.checkpoints_tools.checkpoint import (
    LoadedCheckpoint,
    ParamSharding,
    place,
    resolve_dtype,
    set_path,
)
from jaxserve.checkpoints_tools.hf_names import TensorSpec, hf_tensor_specs, is_ignorable
from jaxserve.checkpoints_tools.tokenizer import load_tokenizer, read_json, read_optional_json
from jaxserve.models import ModelArchConfig, arch_config_from_hf

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class _Located:
    file: pathlib.Path
    shape: tuple[int, ...]


def _weight_files(
    folder: pathlib.Path,
) -> tuple[list[pathlib.Path], pathlib.Path, dict[str, str]]:
    """(safetensors files to read, the file naming them (index or single file), weight_map)."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no 'weight_map' of tensor name -> file")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: listed in {index} but missing")
        return files, index, weight_map
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single], single, {}
    raise FileNotFoundError(
        f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found (only safetensors is supported)"
    )


def _scan_headers(files: Iterable[pathlib.Path]) -> dict[str, _Located]:
    """Every tensor name in the files, with its file and shape (headers only, no data)."""
    found: dict[str, _Located] = {}
    for file in files:
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():
                if name in found:
                    raise ValueError(f"tensor {name!r} is in both {found[name].file} and {file}")
                found[name] = _Located(file, tuple(f.get_slice(name).get_shape()))
    return found


def _check_tensors(
    specs: dict[str, TensorSpec],
    found: dict[str, _Located],
    arch: ModelArchConfig,
    searched: pathlib.Path,
    weight_map: dict[str, str],
) -> None:
    """Raise ValueError naming the tensor and file for a missing, extra or mis-shaped tensor."""
    missing = [name for name in specs if name not in found]
    if missing:
        name = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        where = f"{searched}"
        if name in weight_map:
            where = f"{searched.parent / weight_map[name]} (where {searched.name} places it)"
        raise ValueError(f"missing tensor {name!r}{more} in {where}")
    extra = sorted(n for n in found if n not in specs and not is_ignorable(n, arch))
    if extra:
        raise ValueError(
            f"unexpected tensor {extra[0]!r} in {found[extra[0]].file} (not used by "
            f"{arch.architecture}; {len(extra)} unexpected in all: {extra[:5]})"
        )
    for name, spec in specs.items():
        got = found[name].shape
        if got != spec.hf_shape:
            raise ValueError(
                f"tensor {name!r} in {found[name].file} has shape {got}, expected {spec.hf_shape}"
            )


def _load_tensors(
    specs: dict[str, TensorSpec],
    found: dict[str, _Located],
    dtype: np.dtype,
    param_sharding: ParamSharding | None,
) -> dict[str, Any]:
    params: dict[str, Any] = {}
    by_file: dict[pathlib.Path, list[str]] = {}
    for name in specs:
        by_file.setdefault(found[name].file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="np") as f:
            for name in names:
                spec = specs[name]
                # Cast before converting: a bfloat16 target halves the transposed copy.
                host = spec.convert(f.get_tensor(name).astype(dtype, copy=False))
                placed = place(host, spec.param_path, param_sharding)
                # device_put is asynchronous: wait, so the host copy is released before the
                # next tensor is read, however slow the transfer.
                set_path(params, spec.param_path, placed.block_until_ready())
                del host
    return params


def _read_config(folder: pathlib.Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: missing (a Hugging Face checkpoint needs it)")
    return read_json(config_file)


def load_hf_checkpoint(
    path: str | pathlib.Path,
    *,
    dtype: str = "auto",
    param_sharding: ParamSharding | None = None,
) -> LoadedCheckpoint:
    """Load a Hugging Face checkpoint folder.

    Args:
        path: folder with config.json and model.safetensors (or a sharded
            model.safetensors.index.json); optionally generation_config.json, tokenizer.json,
            tokenizer_config.json.
        dtype: "auto" (config's dtype/torch_dtype when float32/bfloat16/float16, else float32),
            "float32", "bfloat16" or "float16".
        param_sharding: maps a param key path, e.g. ("layers_0", "attn", "q_proj"), to the
            jax.sharding.Sharding to place it in; None = default device.

    Raises:
        FileNotFoundError: the folder, config.json or a weight file is missing (named).
        ValueError: unknown dtype; unsupported architecture/rope type; a missing, unexpected or
            mis-shaped tensor (tensor and file named); malformed JSON (file named).
    """
    folder = pathlib.Path(path)
    cfg = _read_config(folder)
    config_dtype = cfg.get("dtype", cfg.get("torch_dtype"))
    np_dtype = resolve_dtype(dtype, config_dtype)
    try:
        arch = arch_config_from_hf(cfg)
    except ValueError as e:
        raise ValueError(f"{folder / 'config.json'}: {e}") from None
    files, searched, weight_map = _weight_files(folder)
    found = _scan_headers(files)
    specs = hf_tensor_specs(arch)
    _check_tensors(specs, found, arch, searched, weight_map)
    generation_config = read_optional_json(folder / "generation_config.json")
    tokenizer = load_tokenizer(folder)
    params = _load_tensors(specs, found, np_dtype, param_sharding)
    return LoadedCheckpoint(
        arch=arch,
        params=params,
        dtype=np_dtype,
        eos_token_ids=tokenizer.eos_token_ids,
        max_position_embeddings=arch.max_position_embeddings,
        tokenizer=tokenizer,
        generation_config=generation_config,
        path=str(folder),
    )
