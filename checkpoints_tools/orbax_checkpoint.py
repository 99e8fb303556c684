"""jaxserve's Orbax checkpoint folders: parameters restored shard by shard into their target
shardings, next to the Hugging Face config and tokenizer files.

Folder layout (written by convert.py, atomically):

    config.json             the Hugging Face config (the architecture)
    generation_config.json, tokenizer.json, tokenizer_config.json, ...   copied when present
    params/                 the CausalLM params pytree, an Orbax (StandardCheckpointer) item
    jaxserve_orbax.json     the completion marker, written last: {"format", "version", "dtype",
                            "source", "num_params", "quantization"} (quantization: None, or
                            "int8" / "fp8" when the params hold 8-bit linears and their f32
                            scales, models/quant.py; absent in older folders: None)

A folder with params/ but no marker is an interrupted or unfinished conversion and is refused.
Before any array is read, the stored array metadata is checked against the model's parameter
shapes, so a missing, unexpected or mis-shaped array fails with its name.

orbax (and tensorstore) take ~1 s to import: they are imported by the functions that use them,
so that loading a safetensors checkpoint never pays for them.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import numpy as np

from jaxserve.checkpoints_tools.checkpoint import (
    LoadedCheckpoint,
    ParamSharding,
    arch_from_config,
    resolve_dtype,
)
from jaxserve.checkpoints_tools.tokenizer import load_tokenizer, read_json, read_optional_json
from jaxserve.models import get_model

MARKER_FILE = "jaxserve_orbax.json"
PARAMS_DIR = "params"
FORMAT_NAME = "jaxserve-orbax"
# 2: lm_head stored [V, D] (version 1 stored it [D, V]); reconvert older checkpoints.
FORMAT_VERSION = 2


def is_orbax_checkpoint(folder: str | pathlib.Path) -> bool:
    """Whether `folder` is (or was meant to become) a jaxserve Orbax checkpoint: it has the
    marker or a params/ folder. Finished or not: read_marker tells."""
    folder = pathlib.Path(folder)
    return (folder / MARKER_FILE).exists() or (folder / PARAMS_DIR).is_dir()


def read_marker(folder: str | pathlib.Path) -> dict[str, Any]:
    """The completion marker of a finished conversion.

    Raises:
        ValueError: no marker (an interrupted or unfinished conversion), or a marker of another
            format or version (the file is named).
    """
    folder = pathlib.Path(folder)
    marker_file = folder / MARKER_FILE
    if not marker_file.is_file():
        raise ValueError(
            f"{folder}: incomplete Orbax checkpoint: {MARKER_FILE} is missing (the conversion "
            "was interrupted or is still running); convert again with `jaxserve convert`"
        )
    marker = read_json(marker_file)
    if marker.get("format") != FORMAT_NAME or marker.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{marker_file}: expected format {FORMAT_NAME!r} version {FORMAT_VERSION}, got "
            f"{marker.get('format')!r} version {marker.get('version')!r}; convert the source "
            "checkpoint again with `jaxserve convert`"
        )
    return marker


def write_marker(
    folder: pathlib.Path,
    *,
    dtype: np.dtype,
    source: str,
    num_params: int,
    quantization: str | None = None,
) -> None:
    """Write the completion marker: the last file of a conversion."""
    marker = dict(
        format=FORMAT_NAME,
        version=FORMAT_VERSION,
        dtype=np.dtype(dtype).name,
        source=source,
        num_params=num_params,
        quantization=quantization,
    )
    (folder / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def save_params(params: dict[str, Any], directory: pathlib.Path) -> None:
    """Write a params pytree as an Orbax item at `directory` (which must not exist); returns
    when every array is on disk.

    Uncompressed: trained weights barely compress, while decompressing doubles the restore
    time (docs/benchmarks.md, "Design measurements").
    """
    import orbax.checkpoint as ocp

    handler = ocp.PyTreeCheckpointHandler(use_compression=False)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(directory.absolute(), args=ocp.args.PyTreeSave(params))


def _flatten(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """{key path: leaf} of a tree of nested dicts."""
    flat: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, (*prefix, key))
        else:
            flat[(*prefix, key)] = value
    return flat


def check_stored_arrays(
    stored_tree: dict[str, Any], expected: dict[str, Any], directory: pathlib.Path
) -> None:
    """Compare the stored array metadata tree of `directory` with `expected` (a pytree of
    ShapeDtypeStruct).

    Raises:
        ValueError: a missing, unexpected or mis-shaped array, named ("layers_0/attn/q_proj")
            with the folder.
    """
    stored, wanted = _flatten(stored_tree), _flatten(expected)
    name = "/".join
    missing = [path for path in wanted if path not in stored]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"missing array {name(missing[0])!r}{more} in {directory}")
    extra = sorted(path for path in stored if path not in wanted)
    if extra:
        raise ValueError(
            f"unexpected array {name(extra[0])!r} in {directory} ({len(extra)} unexpected in all)"
        )
    for path, leaf in wanted.items():
        got = tuple(stored[path].shape)
        if got != tuple(leaf.shape):
            raise ValueError(
                f"array {name(path)!r} in {directory} has shape {got}, expected {leaf.shape}"
            )


def _stored_quantization(
    marker: dict[str, Any], quantization: str | None, folder: pathlib.Path
) -> str | None:
    """The folder's own quantization (its marker's); ValueError if `quantization` asks for
    another (8-bit weights are stored by convert, never quantized while restoring)."""
    stored_quantization = marker.get("quantization")
    if quantization not in (None, stored_quantization):
        raise ValueError(
            f"quantization={quantization!r} but {folder} holds "
            f"{stored_quantization or 'float'} params ({MARKER_FILE}); convert it again with "
            f"`jaxserve convert --quantization {quantization}` or pass quantization=None"
        )
    return stored_quantization


def _restore_targets(shapes: dict[str, Any], param_sharding: ParamSharding | None) -> Any:
    """The restore target of each param: its shape and own dtype in param_sharding(its key
    path), or on the first local device when param_sharding is None."""
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def target(key_path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        keys = tuple(k.key for k in key_path)
        sharding = default if param_sharding is None else param_sharding(keys)
        # The leaf's own dtype: the load dtype, or an 8-bit weight / f32 scale (never cast).
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(target, shapes)


def load_orbax_checkpoint(
    path: str | pathlib.Path,
    *,
    dtype: str = "auto",
    param_sharding: ParamSharding | None = None,
    quantization: str | None = None,
) -> LoadedCheckpoint:
    """Load a jaxserve Orbax checkpoint folder (see the module docstring).

    Each array is read straight into param_sharding(its key path): every device reads only its
    own shard from disk, and no device ever holds a full copy of a sharded parameter.

    Args:
        dtype: "auto" (the dtype it was converted to), "float32", "bfloat16" or "float16"
            (cast while reading).
        param_sharding: as for load_hf_checkpoint; None = the default device.
        quantization: None (the folder's own, its marker's "quantization"), or that same
            value; 8-bit weights are stored by `jaxserve convert --quantization`, never
            quantized while restoring.

    Raises:
        ValueError: an unfinished conversion (no marker); a missing, unexpected or mis-shaped
            array (named); unknown dtype; unsupported architecture; malformed JSON (file named);
            a quantization other than the folder's own.
        FileNotFoundError: config.json or params/ missing.
        TypeError: a config.json value of the wrong type (file and key named).
    """
    import orbax.checkpoint as ocp

    folder = pathlib.Path(path)
    marker = read_marker(folder)
    params_dir = folder / PARAMS_DIR
    config_file = folder / "config.json"
    for needed in (config_file, params_dir):
        if not needed.exists():
            raise FileNotFoundError(f"{needed}: missing from the Orbax checkpoint")
    arch = arch_from_config(read_json(config_file), config_file)
    np_dtype = resolve_dtype(dtype, marker.get("dtype"))
    stored_quantization = _stored_quantization(marker, quantization, folder)
    shapes = get_model(arch, dtype=np_dtype, quantization=stored_quantization).param_shapes()
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(params_dir.absolute()).item_metadata.tree
        check_stored_arrays(dict(stored), shapes, params_dir)
        abstract = _restore_targets(shapes, param_sharding)
        params = checkpointer.restore(params_dir.absolute(), abstract)
    tokenizer = load_tokenizer(folder)
    return LoadedCheckpoint(
        arch=arch,
        params=params,
        dtype=np_dtype,
        eos_token_ids=tokenizer.eos_token_ids,
        max_position_embeddings=arch.max_position_embeddings,
        tokenizer=tokenizer,
        generation_config=read_optional_json(folder / "generation_config.json"),
        path=str(folder),
        quantization=stored_quantization,
    )
