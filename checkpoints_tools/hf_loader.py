"""Load a Hugging Face checkpoint folder (config.json + safetensors) into jaxserve params.

Loading is lazy and checked up front: first every safetensors header is read (names, shapes,
dtypes; no data) and checked against what the architecture needs, so a bad checkpoint fails
before anything is allocated; then tensors are read one at a time, converted (cast, transposed,
reshaped) and placed on device before the next is read, so host memory holds at most one
tensor, never a second copy of the model. Two cases hold a little more: a fused tensor (Phi-3's
qkv_proj) is cut into its params from the one read, and per-expert MoE tensors are copied into
a host buffer of their stacked param, which is placed once its last expert arrives (the
buffer is one stacked param, e.g. one layer's experts_gate; 8-bit experts fill an 8-bit buffer
and its f32 scales' buffer).

Only floating-point weights (F16, BF16, F32, F64) are cast: an integer or boolean weight is
refused rather than cast (a cast would make nonsense weights), except the 8-bit linears of a
checkpoint whose config.json declares them (quantization.py: FP8 / int8 weights with their
scales, read as they are); LLM(quantization=...) quantizes a float checkpoint's linears tensor
by tensor. NaN or Inf values are reported in one warning after loading, from one on-device
check per tensor.
"""

from __future__ import annotations

import functools
import logging
import pathlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoints_tools.checkpoint import (
    DTYPE_NAMES,
    LoadedCheckpoint,
    ParamSharding,
    arch_from_config,
    place,
    resolve_dtype,
    set_path,
)
from jaxserve.checkpoints_tools.hf_names import TensorSpec, hf_tensor_specs, is_ignorable
from jaxserve.checkpoints_tools.quantization import (
    STORED_DTYPES,
    QuantizedLoad,
    read_fp8_tensor,
    read_quantization_config,
    resolve_quantization,
)
from jaxserve.checkpoints_tools.safetensors_index import (
    Located,
    open_safetensors,
    read_tensor,
    scan_headers,
    weight_files,
)
from jaxserve.checkpoints_tools.tokenizer import load_tokenizer, read_json, read_optional_json
from jaxserve.models import ModelArchConfig

# safetensors dtype names (the header's "dtype") of the weights jaxserve reads and casts.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# How many non-finite tensors the warning names (it gives the total count too).
MAX_NAMED_NON_FINITE = 5

logger = logging.getLogger("jaxserve")


def _check_dtypes(
    specs: dict[str, TensorSpec], found: dict[str, Located], quantized: set[str]
) -> None:
    """Raise ValueError naming the tensor, file and dtype of a weight that is not floating point.

    Checked before missing or unexpected tensors: an FP8 checkpoint also has scale tensors the
    model does not know, and "FP8 is not supported" is the useful message, not "unexpected".
    """
    for name in specs:
        located = found.get(name)
        if located is None or located.dtype in FLOAT_DTYPES or name in quantized:
            continue
        where = f"tensor {name!r} in {located.file} has dtype {located.dtype}"
        if located.dtype.startswith("F8_"):
            raise ValueError(
                f"{where}, but config.json declares no FP8 quantization_config (a quantized "
                "checkpoint says how its weights are scaled)"
            )
        raise ValueError(
            f"{where}; only floating-point weights ({', '.join(FLOAT_DTYPES)}) are supported "
            "(an integer or boolean weight is not cast: is this a quantized checkpoint?)"
        )


def _check_tensors(
    specs: dict[str, TensorSpec],
    found: dict[str, Located],
    arch: ModelArchConfig,
    searched: pathlib.Path,
    weight_map: dict[str, str],
    quant: QuantizedLoad | None,
) -> None:
    """Raise ValueError naming the tensor and file for a non-float, missing, extra or
    mis-shaped tensor (8-bit linears and their scales: quantization.QuantizedLoad.check)."""
    quantized = set() if quant is None else quant.check(arch, specs, found)
    _check_dtypes(specs, found, quantized)
    missing = [name for name in specs if name not in found]
    if missing:
        name = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        where = f"{searched}"
        if name in weight_map:
            where = f"{searched.parent / weight_map[name]} (where {searched.name} places it)"
        raise ValueError(f"missing tensor {name!r}{more} in {where}")
    scales = set() if quant is None else set(quant.scale_names(specs).values())
    extra = sorted(
        n for n in found if n not in specs and n not in scales and not is_ignorable(n, arch)
    )
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


@dataclass
class _Stack:
    """A stacked param's host buffer while its slices are read (hf_names.TensorSpec.stack)."""

    value: np.ndarray  # [E, ...] in the load dtype
    filled: set[int]  # slices copied so far


@jax.jit
def _finite(x: jax.Array) -> jax.Array:
    # One fused reduction on the array where it lives (sharded or not): no host copy, no sync.
    return jnp.all(jnp.isfinite(x))


def _all_finite(x: jax.Array) -> jax.Array | bool:
    """Whether ``x`` is all finite: a device bool, no host round trip. On a mesh over several
    processes, a host bool over this process's shards only, each reduced on its own device: a
    reduction over the whole mesh would be a cross-process collective, which a load never issues
    (checkpoint.place); each process then warns of what it holds."""
    if x.is_fully_addressable:
        return _finite(x)
    return all(bool(_finite(shard.data)) for shard in x.addressable_shards)


def _load_tensors(
    specs: dict[str, TensorSpec],
    found: dict[str, Located],
    dtype: np.dtype,
    param_sharding: ParamSharding | None,
    quant: QuantizedLoad | None = None,
) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """Read, convert and place every tensor of `specs`, one at a time (a quantized linear as
    its 8-bit weight and f32 scale: quantization.QuantizedLoad.params).

    Returns:
        (params, {tensor name: device bool, whether all its values are finite}); the booleans
        are left on device so that checking costs no host round trip per tensor.
    """
    params: dict[str, Any] = {}
    finite: dict[str, Any] = {}
    stacks: dict[tuple[str, ...], _Stack] = {}
    by_file: dict[pathlib.Path, list[str]] = {}
    for name in specs:
        by_file.setdefault(found[name].file, []).append(name)

    def put(path: tuple[str, ...], host: np.ndarray) -> jax.Array:
        placed = place(host, path, param_sharding)
        # device_put is asynchronous: wait, so the host copy is released before the next
        # tensor is read, however slow the transfer.
        set_path(params, path, placed.block_until_ready())
        return _all_finite(placed)

    linears = set() if quant is None else quant.linears(specs)
    scale_names = {} if quant is None else quant.scale_names(specs)
    scales = _read_scales(scale_names.values(), found)
    for file, names in by_file.items():
        with open_safetensors(file) as f:
            for name in names:
                spec = specs[name]
                if name in linears:
                    scale = scales.pop(scale_names[name]) if name in scale_names else None
                    tensor = _read_stored(f, file, name, found[name])
                    parts = quant.params(spec, tensor, scale)
                    finite[name] = _place_parts(parts, spec, stacks, put)
                    continue
                # Cast before converting: a bfloat16 target halves the transposed copy. A value
                # beyond the target's range becomes Inf: _warn_non_finite names the tensor,
                # numpy's own anonymous warning would not.
                with np.errstate(over="ignore"):
                    tensor = read_tensor(f, name, file).astype(dtype, copy=False)
                if spec.stack is not None:
                    host = spec.convert(tensor)
                    finite[name] = _stack_slice(stacks, spec.param_path, spec.stack, host, put)
                    continue
                flags = [put(part.param_path, part.convert(tensor)) for part in spec.targets()]
                finite[name] = functools.reduce(jnp.logical_and, flags)
                del tensor
    assert not stacks, f"stacked params left incomplete: {sorted(stacks)}"  # specs list all E
    return params, finite


def _read_stored(f: Any, file: pathlib.Path, name: str, located: Located) -> np.ndarray:
    """A quantized linear's weight as stored, not cast (FP8 through read_fp8_tensor; int8, or
    a float weight that the load quantizes, as read from the open file `f`)."""
    if located.dtype == STORED_DTYPES["fp8"]:
        return read_fp8_tensor(file, name)
    return read_tensor(f, name, file)


def _place_parts(
    parts: list[tuple[tuple[str, ...], np.ndarray]],
    spec: TensorSpec,
    stacks: dict[tuple[str, ...], _Stack],
    put: Callable[[tuple[str, ...], np.ndarray], jax.Array],
) -> jax.Array | bool:
    """Place a quantized linear's (param path, host array) parts, a MoE expert's into its
    stacked params' buffers. Returns whether every part is all finite."""
    if spec.stack is not None:  # a MoE expert: its 8-bit slice and scale row
        oks = [_stack_slice(stacks, p, spec.stack, h, put) for p, h in parts]
        return all(oks)
    flags = [put(path, host) for path, host in parts]
    return functools.reduce(jnp.logical_and, flags)


def _read_scales(names: Iterable[str], found: dict[str, Located]) -> dict[str, np.ndarray]:
    """The stored 8-bit weights' scale tensors (small: one float per output channel at most),
    read up front since a scale may sit in another file than its weight."""
    by_file: dict[pathlib.Path, list[str]] = {}
    for name in names:
        by_file.setdefault(found[name].file, []).append(name)
    scales = {}
    for file, in_file in by_file.items():
        with open_safetensors(file) as f:
            scales.update({name: read_tensor(f, name, file) for name in in_file})
    return scales


def _stack_slice(
    stacks: dict[tuple[str, ...], _Stack],
    path: tuple[str, ...],
    slot: tuple[int, int],
    host: np.ndarray,
    put: Callable[[tuple[str, ...], np.ndarray], jax.Array],
) -> bool:
    """Copy one converted expert tensor (or an 8-bit expert's weight or scale) into slice
    slot[0] of the stacked param `path`'s buffer of slot[1] slices; place the param when its
    last slice arrives. Returns whether the slice is all finite (checked on the host: the
    placed stack's check could not name the expert)."""
    index, count = slot
    stack = stacks.get(path)
    if stack is None:
        stack = stacks[path] = _Stack(np.empty((count, *host.shape), host.dtype), set())
    stack.value[index] = host
    stack.filled.add(index)
    if len(stack.filled) == count:
        put(path, stacks.pop(path).value)
    return bool(np.isfinite(host).all())


def _warn_non_finite(
    finite: dict[str, jax.Array], found: dict[str, Located], dtype: np.dtype
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


def config_dtype(cfg: dict[str, Any], config_file: pathlib.Path) -> object:
    """config.json's "dtype" (or the older "torch_dtype"), as written. A value jaxserve does not
    compute in (e.g. "int8") logs one warning naming the key and saying that dtype="auto"
    treats the checkpoint as float32 (the documented fallback: resolve_dtype, plan.py)."""
    key = "dtype" if "dtype" in cfg else "torch_dtype"
    value = cfg.get(key)
    if value is not None and value not in DTYPE_NAMES:
        logger.warning(
            "%s %s=%r is not a dtype jaxserve computes in (%s): dtype='auto' treats the "
            "checkpoint as float32 (bfloat16 on GPU and TPU); pass dtype= to choose",
            config_file,
            key,
            value,
            ", ".join(DTYPE_NAMES),
        )
    return value


def _resolve_quantized_load(
    cfg: dict[str, Any], quantization: str | None, folder: pathlib.Path
) -> tuple[str | None, QuantizedLoad | None]:
    """The quantization the load applies (the argument against config.json's
    quantization_config: quantization.resolve_quantization) and its QuantizedLoad, or
    (None, None) for a float load."""
    stored = read_quantization_config(cfg)
    quantization = resolve_quantization(quantization, stored, str(folder))
    quant = None if quantization is None else QuantizedLoad(quantization, stored)
    return quantization, quant


def _checked_specs(
    folder: pathlib.Path, arch: ModelArchConfig, quant: QuantizedLoad | None
) -> tuple[dict[str, TensorSpec], dict[str, Located]]:
    """The tensors `arch` needs and those the folder's safetensors headers hold, checked
    against each other (_check_tensors) before any data is read."""
    files, searched, weight_map = weight_files(folder)
    found = scan_headers(files)
    specs = hf_tensor_specs(arch, found)
    _check_tensors(specs, found, arch, searched, weight_map, quant)
    return specs, found


def load_hf_checkpoint(
    path: str | pathlib.Path,
    *,
    dtype: str = "auto",
    param_sharding: ParamSharding | None = None,
    quantization: str | None = None,
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
        quantization: None (the checkpoint's own precision: an FP8 / int8 checkpoint's
            quantization_config applies), or "int8" / "fp8": quantize the decoder layers'
            linear weights per output channel while loading (quantization.py).

    Returns:
        The checkpoint, its params on device. NaN or Inf weights are loaded, with one warning
        on the "jaxserve" logger naming them and their files.

    Raises:
        FileNotFoundError: the folder, config.json or a weight file is missing (named).
        ValueError: unknown dtype; unsupported architecture/rope type or a bad config value
            (key named); a missing, unexpected, mis-shaped, integer, boolean or FP8 tensor
            (tensor, file and dtype named); a truncated or corrupt safetensors file (file and,
            when reading its data, tensor named); malformed JSON (file named); a
            quantization_config the engine cannot honour (key named), or a quantization that
            differs from the checkpoint's own.
        TypeError: a config.json value of the wrong type (key named).
    """
    folder = pathlib.Path(path)
    cfg = _read_config(folder)
    # The config's dtype matters (and is warned about) only for "auto".
    declared = config_dtype(cfg, folder / "config.json") if dtype == "auto" else None
    np_dtype = resolve_dtype(dtype, declared)
    arch = arch_from_config(cfg, folder / "config.json")
    quantization, quant = _resolve_quantized_load(cfg, quantization, folder)
    specs, found = _checked_specs(folder, arch, quant)
    generation_config = read_optional_json(folder / "generation_config.json")
    tokenizer = load_tokenizer(folder)
    params, finite = _load_tensors(specs, found, np_dtype, param_sharding, quant)
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
        quantization=quantization,
    )
