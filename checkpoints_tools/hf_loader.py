"""Load a Hugging Face checkpoint folder (config.json + safetensors) into jaxserve params.

Loading is lazy and checked up front: first every safetensors header is read (names, shapes,
dtypes; no data) and checked against what the architecture needs, so a bad checkpoint fails
before anything is allocated; then tensors are read one at a time, converted (cast, transposed,
reshaped) and placed on device before the next is read, so host memory holds at most one
tensor, never a second copy of the model.

Only floating-point weights (F16, BF16, F32, F64) are read: an integer or boolean weight is
refused rather than cast (it is a quantized or corrupt checkpoint, and a cast would make
nonsense weights), and FP8 checkpoints are refused as not supported yet. NaN or Inf values are
reported in one warning after loading, from one on-device check per tensor.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxserve.checkpoints_tools.checkpoint import (
    LoadedCheckpoint,
    ParamSharding,
    arch_from_config,
    place,
    resolve_dtype,
    set_path,
)
from jaxserve.checkpoints_tools.hf_names import TensorSpec, hf_tensor_specs, is_ignorable
from jaxserve.checkpoints_tools.tokenizer import load_tokenizer, read_json, read_optional_json
from jaxserve.models import ModelArchConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names (the header's "dtype") of the weights jaxserve reads and casts.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# How many non-finite tensors the warning names (it gives the total count too).
MAX_NAMED_NON_FINITE = 5

logger = logging.getLogger("jaxserve")


@dataclass(frozen=True)
class _Located:
    file: pathlib.Path
    shape: tuple[int, ...]
    dtype: str  # the safetensors header's name: "F32", "BF16", "I64", "F8_E4M3", ...


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


@contextlib.contextmanager
def _open_safetensors(file: pathlib.Path) -> Iterator[Any]:
    """safe_open(file), its errors (truncated file, corrupt header, unreadable) as a ValueError
    naming the file: the library's own message does not."""
    try:
        handle = safe_open(str(file), framework="np")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
    with handle as f:
        yield f


def _scan_headers(files: Iterable[pathlib.Path]) -> dict[str, _Located]:
    """Every tensor name in the files, with its file, shape and dtype (headers only, no data).

    Raises:
        ValueError: a file is not readable safetensors, or a name is in two files (named).
    """
    found: dict[str, _Located] = {}
    for file in files:
        with _open_safetensors(file) as f:
            for name in f.keys():
                if name in found:
                    raise ValueError(f"tensor {name!r} is in both {found[name].file} and {file}")
                header = f.get_slice(name)
                found[name] = _Located(file, tuple(header.get_shape()), header.get_dtype())
    return found


def _check_dtypes(specs: dict[str, TensorSpec], found: dict[str, _Located]) -> None:
    """Raise ValueError naming the tensor, file and dtype of a weight that is not floating point.

    Checked before missing or unexpected tensors: an FP8 checkpoint also has scale tensors the
    model does not know, and "FP8 is not supported" is the useful message, not "unexpected".
    """
    for name in specs:
        located = found.get(name)
        if located is None or located.dtype in FLOAT_DTYPES:
            continue
        where = f"tensor {name!r} in {located.file} has dtype {located.dtype}"
        if located.dtype.startswith("F8_"):
            raise ValueError(f"{where}: quantized (FP8) checkpoints are not supported yet")
        raise ValueError(
            f"{where}; only floating-point weights ({', '.join(FLOAT_DTYPES)}) are supported "
            "(an integer or boolean weight is not cast: is this a quantized checkpoint?)"
        )


def _check_tensors(
    specs: dict[str, TensorSpec],
    found: dict[str, _Located],
    arch: ModelArchConfig,
    searched: pathlib.Path,
    weight_map: dict[str, str],
) -> None:
    """Raise ValueError naming the tensor and file for a non-float, missing, extra or
    mis-shaped tensor."""
    _check_dtypes(specs, found)
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


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    # One fused reduction on the array where it lives (sharded or not): no host copy, no sync.
    return jnp.all(jnp.isfinite(x))


def _read_tensor(f: Any, name: str, file: pathlib.Path) -> np.ndarray:
    try:
        return f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: cannot read tensor {name!r} ({e})") from None


def _load_tensors(
    specs: dict[str, TensorSpec],
    found: dict[str, _Located],
    dtype: np.dtype,
    param_sharding: ParamSharding | None,
) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """Read, convert and place every tensor of `specs`, one at a time.

    Returns:
        (params, {tensor name: device bool, whether all its values are finite}); the booleans
        are left on device so that checking costs no host round trip per tensor.
    """
    params: dict[str, Any] = {}
    finite: dict[str, jax.Array] = {}
    by_file: dict[pathlib.Path, list[str]] = {}
    for name in specs:
        by_file.setdefault(found[name].file, []).append(name)
    for file, names in by_file.items():
        with _open_safetensors(file) as f:
            for name in names:
                spec = specs[name]
                # Cast before converting: a bfloat16 target halves the transposed copy. A value
                # beyond the target's range becomes Inf: _warn_non_finite names the tensor,
                # numpy's own anonymous warning would not.
                with np.errstate(over="ignore"):
                    host = spec.convert(_read_tensor(f, name, file).astype(dtype, copy=False))
                placed = place(host, spec.param_path, param_sharding)
                # device_put is asynchronous: wait, so the host copy is released before the
                # next tensor is read, however slow the transfer.
                set_path(params, spec.param_path, placed.block_until_ready())
                finite[name] = _all_finite(placed)
                del host
    return params, finite


def _warn_non_finite(
    finite: dict[str, jax.Array], found: dict[str, _Located], dtype: np.dtype
) -> None:
    """One warning naming the tensors with NaN or Inf values (after the cast to `dtype`: a
    float32 value beyond float16's range becomes Inf), if any."""
    flags = jax.device_get(list(finite.values()))  # one fetch for every tensor
    bad = [name for name, ok in zip(finite, flags, strict=True) if not ok]
    if not bad:
        return
    named = ", ".join(f"{name!r} ({found[name].file})" for name in bad[:MAX_NAMED_NON_FINITE])
    more = f" and {len(bad) - MAX_NAMED_NON_FINITE} more" if len(bad) > MAX_NAMED_NON_FINITE else ""
    logger.warning(
        "%d tensor(s) hold NaN or Inf values as loaded in %s: %s%s; expect NaN or "
        "meaningless outputs",
        len(bad),
        np.dtype(dtype).name,
        named,
        more,
    )


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

    Returns:
        The checkpoint, its params on device. NaN or Inf weights are loaded, with one warning
        on the "jaxserve" logger naming them and their files.

    Raises:
        FileNotFoundError: the folder, config.json or a weight file is missing (named).
        ValueError: unknown dtype; unsupported architecture/rope type or a bad config value
            (key named); a missing, unexpected, mis-shaped, integer, boolean or FP8 tensor
            (tensor, file and dtype named); a truncated or corrupt safetensors file (file and,
            when reading its data, tensor named); malformed JSON (file named).
        TypeError: a config.json value of the wrong type (key named).
    """
    folder = pathlib.Path(path)
    cfg = _read_config(folder)
    config_dtype = cfg.get("dtype", cfg.get("torch_dtype"))
    np_dtype = resolve_dtype(dtype, config_dtype)
    arch = arch_from_config(cfg, folder / "config.json")
    files, searched, weight_map = _weight_files(folder)
    found = _scan_headers(files)
    specs = hf_tensor_specs(arch)
    _check_tensors(specs, found, arch, searched, weight_map)
    generation_config = read_optional_json(folder / "generation_config.json")
    tokenizer = load_tokenizer(folder)
    params, finite = _load_tensors(specs, found, np_dtype, param_sharding)
    _warn_non_finite(finite, found, np_dtype)
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
