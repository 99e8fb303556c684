"""A checkpoint's weights as shapes: what compiling needs, before (or without) reading them.

``abstract_checkpoint`` gives a LoadedCheckpoint whose params are jax.ShapeDtypeStructs in
their shardings (the plan's dtype and quantization) and whose other facts come from the
checkpoint's small files (config.json, the tokenizer's files for the EOS ids, which size the
sampler's ban lists): a ModelRunner built from it holds the same jitted step and buckets as
one built from the loaded weights, so its warm-up can compile while they load
(runner/startup.py), or for a chip that is not here (jaxserve/aot). ``matches`` checks a loaded
checkpoint against it, leaf by leaf.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.checkpoints_tools import LoadedCheckpoint, TokenizerInfo
from jaxserve.checkpoints_tools.tiny_random import TINY_RANDOM_LLAMA, tiny_tokenizer_info
from jaxserve.checkpoints_tools.tokenizer import load_tokenizer
from jaxserve.models import CausalLM, ModelArchConfig, get_model


def abstract_params(model: CausalLM, shardings: Any) -> Any:
    """``model``'s params as jax.ShapeDtypeStructs placed by ``shardings``."""
    return jax.tree_util.tree_map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        model.param_shapes(),
        shardings,
    )


def abstract_checkpoint(
    arch: ModelArchConfig,
    source: str,
    *,
    dtype: str,
    quantization: str | None,
    shardings: Any,
    with_tokenizer: bool = False,
) -> LoadedCheckpoint:
    """The checkpoint at ``source`` (a folder, or a built-in model's name) with abstract params
    in ``dtype`` and ``quantization`` placed by ``shardings``, the folder's EOS ids and, with
    ``with_tokenizer``, its tokenizer (the one the load gives: a job handed to the engine's
    construction tokenizes its prompts with it while the weights load, job_startup.py), else
    none (the tokenizer's files are read for the EOS ids only)."""
    model = get_model(arch, dtype=dtype, quantization=quantization)
    folder = pathlib.Path(source)
    if folder.is_dir():
        tokenizer = load_tokenizer(folder)
    elif source == TINY_RANDOM_LLAMA and with_tokenizer:
        tokenizer = tiny_tokenizer_info()
    else:  # a built-in model
        tokenizer = TokenizerInfo(None, eos_token_ids=frozenset(arch.eos_token_ids))
    if not with_tokenizer:
        tokenizer = dataclasses.replace(tokenizer, tokenizer=None)
    return LoadedCheckpoint(
        arch=arch,
        params=abstract_params(model, shardings),
        dtype=jnp.dtype(dtype),
        eos_token_ids=tokenizer.eos_token_ids,
        max_position_embeddings=arch.max_position_embeddings,
        tokenizer=tokenizer,
        path=str(folder) if folder.is_dir() else None,
        quantization=quantization,
    )


def mismatch(abstract: LoadedCheckpoint, loaded: LoadedCheckpoint) -> str | None:
    """What differs between the abstract checkpoint a runner was built from and the loaded
    one (the first difference, named), or None when the runner's compiled steps fit the
    loaded weights: the same tree, every leaf's shape, dtype and sharding, the same dtype,
    quantization and EOS ids."""
    for field in ("dtype", "quantization", "eos_token_ids"):
        want, got = getattr(abstract, field), getattr(loaded, field)
        if want != got:
            return f"{field}: expected {want}, loaded {got}"
    want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(abstract.params)
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(loaded.params)
    if want_tree != got_tree:
        return f"the params' tree: expected {want_tree}, loaded {got_tree}"
    for (path, want), (_, got) in zip(want_leaves, got_leaves, strict=True):
        name = jax.tree_util.keystr(path)
        for attr in ("shape", "dtype"):
            if getattr(want, attr) != getattr(got, attr):
                return f"{name}: {attr} expected {getattr(want, attr)}, loaded {getattr(got, attr)}"
        placed = getattr(got, "sharding", None)
        if want.sharding is not None and placed is not None and want.sharding != placed:
            return f"{name}: sharding expected {want.sharding}, loaded {placed}"
    return None
