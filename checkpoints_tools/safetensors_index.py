"""A safetensors checkpoint's files and headers: which files (a single file or an index), every
tensor's file, shape and dtype read from the headers alone, and reading one tensor, with the
library's errors turned into ValueErrors that name the file."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from jaxserve.checkpoints_tools.tokenizer import read_json

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Located:
    """Where a tensor is, and its header's shape and dtype."""

    file: pathlib.Path
    shape: tuple[int, ...]
    dtype: str  # the safetensors header's name: "F32", "BF16", "I64", "F8_E4M3", ...


def weight_files(
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


@contextlib.contextmanager
def open_safetensors(file: pathlib.Path) -> Iterator[Any]:
    """safe_open(file), its errors (truncated file, corrupt header, unreadable) as a ValueError
    naming the file: the library's own message does not."""
    try:
        handle = safe_open(str(file), framework="np")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
    with handle as f:
        yield f


def scan_headers(files: Iterable[pathlib.Path]) -> dict[str, Located]:
    """Every tensor name in the files, with its file, shape and dtype (headers only, no data).

    Raises:
        ValueError: a file is not readable safetensors, or a name is in two files (named).
    """
    found: dict[str, Located] = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                if name in found:
                    raise ValueError(f"tensor {name!r} is in both {found[name].file} and {file}")
                header = f.get_slice(name)
                found[name] = Located(file, tuple(header.get_shape()), header.get_dtype())
    return found


def read_tensor(f: Any, name: str, file: pathlib.Path) -> np.ndarray:
    try:
        return f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: cannot read tensor {name!r} ({e})") from None
