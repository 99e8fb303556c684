"""LoadedCheckpoint (what every loader returns) and the helpers loaders share: dtype names, the
architecture of a config file, and placing one parameter on device."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoints_tools.tokenizer import TokenizerInfo
from jaxserve.models import ModelArchConfig, arch_config_from_hf

DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Maps a parameter's key path, e.g. ("layers_0", "attn", "q_proj"), to where it should live.
ParamSharding = Callable[[tuple[str, ...]], jax.sharding.Sharding]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A model ready to run: architecture, device params and what generation needs to know.

    params: the pytree of models.CausalLM (see its docstring), every leaf in `dtype`, already
        on device (placed by param_sharding when one was given).
    dtype: numpy dtype of the params (float32, bfloat16 or float16); pass it to get_model.
    eos_token_ids: ids that end generation (config.json + generation_config.json + tokenizer).
    tokenizer: the tokenizer and its special tokens (TokenizerInfo.tokenizer may be None).
    generation_config: generation_config.json as a dict ({} when absent).
    path: the folder loaded from; None for a built-in model.
    quantization: None, or "int8" / "fp8": the decoder's linear weights are 8-bit with f32
        scales (models/quant.py); pass it to get_model.
    """

    arch: ModelArchConfig
    params: dict[str, Any]
    dtype: np.dtype
    eos_token_ids: frozenset[int]
    max_position_embeddings: int
    tokenizer: TokenizerInfo
    generation_config: dict[str, Any] = field(default_factory=dict)
    path: str | None = None
    quantization: str | None = None


def resolve_dtype(dtype: str, config_dtype: object = None) -> np.dtype:
    """The params dtype for a requested name; "auto" takes the checkpoint's own dtype when it
    is float32/bfloat16/float16, else float32.

    Raises:
        ValueError: dtype is not "auto", "float32", "bfloat16" or "float16".
    """
    if dtype == "auto":
        name = config_dtype if config_dtype in DTYPE_NAMES else "float32"
        return np.dtype(DTYPE_NAMES[name])
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {['auto', *DTYPE_NAMES]}, got {dtype!r}")
    return np.dtype(DTYPE_NAMES[dtype])


def place(
    value: np.ndarray | jax.Array, path: tuple[str, ...], param_sharding: ParamSharding | None
) -> jax.Array:
    """Put one parameter on device: into param_sharding(path) if given, else the default.

    On a mesh over several processes each process places its own shards from its own copy
    (jax.make_array_from_callback): jax.device_put would first check, with a cross-process
    collective, that every process holds the same value, and the load runs in a thread beside
    the caller's own cross-process computations (runner/startup.py), whose order must be the
    same in every process. So a load issues none."""
    if param_sharding is None:
        return jax.device_put(value)
    sharding = param_sharding(path)
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def set_path(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """tree[path[0]][path[1]]... = value, creating the intermediate dicts."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def arch_from_config(cfg: dict[str, Any], config_file: pathlib.Path) -> ModelArchConfig:
    """arch_config_from_hf(cfg), with its errors prefixed by the file they came from.

    Raises:
        ValueError / TypeError: as arch_config_from_hf, the message starting with config_file.
    """
    try:
        return arch_config_from_hf(cfg)
    except TypeError as e:
        raise TypeError(f"{config_file}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None
