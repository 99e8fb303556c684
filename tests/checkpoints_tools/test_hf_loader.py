"""load_hf_checkpoint on real folders written by transformers: layouts, dtypes, bad input."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxserve.checkpoints_tools.hf_loader as hf_loader
from jaxserve.checkpoints_tools import load_hf_checkpoint
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint
from jaxserve.models import get_model

LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("single")
    return write_tiny_hf_checkpoint(folder, "llama", rope_scaling=LLAMA3_ROPE)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("sharded")
    return write_tiny_hf_checkpoint(
        folder, "llama", rope_scaling=LLAMA3_ROPE, max_shard_size="40KB"
    )


@pytest.fixture()
def copy_of(tmp_path):
    return lambda src: pathlib.Path(shutil.copytree(src, tmp_path / "ckpt"))


def test_sharded_equals_single_and_matches_model_layout(single, sharded) -> None:
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert (sharded / "model.safetensors.index.json").is_file() and len(shards) > 1
    a, b = load_hf_checkpoint(single), load_hf_checkpoint(sharded)
    assert a.arch == b.arch and a.arch.rope_scaling["type"] == "llama3"
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, a.params, b.params))
    shapes = get_model(a.arch, dtype=a.dtype).param_shapes()
    same = jax.tree_util.tree_map(
        lambda p, s: p.shape == s.shape and p.dtype == s.dtype, a.params, shapes
    )
    assert all(jax.tree_util.tree_leaves(same))
    assert a.dtype == np.float32 and a.max_position_embeddings == 256
    assert a.generation_config["eos_token_id"] == 2


def test_old_rope_scaling_form_loads_the_same(single, copy_of) -> None:
    folder = copy_of(single)
    cfg = json.loads((folder / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    assert params["rope_type"] == "llama3"  # what transformers 5 writes
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {"type": params.pop("rope_type"), **params}  # transformers < 5
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_hf_checkpoint(folder).arch == load_hf_checkpoint(single).arch


def _rewrite(file: pathlib.Path, edit) -> None:
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.fixture()
def no_placement(monkeypatch):
    """Fail the test if anything is placed on device: errors must come before allocation."""
    placed = []
    monkeypatch.setattr(hf_loader, "place", lambda *a: placed.append(a))
    yield
    assert not placed


NAME = "model.layers.1.mlp.up_proj.weight"


def test_missing_tensor_names_tensor_and_file(single, copy_of, no_placement) -> None:
    folder = copy_of(single)
    _rewrite(folder / "model.safetensors", lambda t: t.pop(NAME))
    with pytest.raises(ValueError, match=rf"{NAME}.*model\.safetensors"):
        load_hf_checkpoint(folder)


def test_missing_tensor_in_shard_names_the_shard(sharded, copy_of, no_placement) -> None:
    folder = copy_of(sharded)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][NAME]
    _rewrite(folder / shard, lambda t: t.pop(NAME))
    with pytest.raises(ValueError, match=rf"{NAME}.*{shard}"):
        load_hf_checkpoint(folder)


def test_missing_shard_file_is_named(sharded, copy_of) -> None:
    folder = copy_of(sharded)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_hf_checkpoint(folder)


def test_misshaped_tensor_names_tensor_shapes_and_file(single, copy_of, no_placement) -> None:
    folder = copy_of(single)
    _rewrite(folder / "model.safetensors", lambda t: t.__setitem__(NAME, t[NAME].T.copy()))
    with pytest.raises(ValueError, match=rf"{NAME}.*model\.safetensors.*\(64, 128\).*\(128, 64\)"):
        load_hf_checkpoint(folder)


def test_unexpected_tensor_raises_but_inv_freq_is_ignored(single, copy_of) -> None:
    folder = copy_of(single)
    extra = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _rewrite(folder / "model.safetensors", lambda t: t.__setitem__(extra, np.ones(8, np.float32)))
    load_hf_checkpoint(folder)
    extra = "model.layers.0.self_attn.extra_proj.weight"
    _rewrite(folder / "model.safetensors", lambda t: t.__setitem__(extra, np.ones(8, np.float32)))
    with pytest.raises(ValueError, match=rf"unexpected tensor '{extra}'.*model\.safetensors"):
        load_hf_checkpoint(folder)


def test_missing_folder_config_and_weights(single, copy_of, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nowhere")
    folder = copy_of(single)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(folder)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(folder)


def test_unsupported_architecture_names_it_and_the_file(single, copy_of) -> None:
    folder = copy_of(single)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match=r"config\.json.*FalconForCausalLM"):
        load_hf_checkpoint(folder)


def test_dtypes(single, copy_of) -> None:
    f32 = load_hf_checkpoint(single)
    bf16 = load_hf_checkpoint(single, dtype="bfloat16")
    assert bf16.dtype == jnp.bfloat16
    cast = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), f32.params)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, cast, bf16.params))
    assert all(y.dtype == jnp.bfloat16 for y in jax.tree_util.tree_leaves(bf16.params))
    folder = copy_of(single)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"dtype": "bfloat16"}))
    assert load_hf_checkpoint(folder).dtype == jnp.bfloat16  # "auto" follows the config
    assert load_hf_checkpoint(folder, dtype="float16").dtype == jnp.float16
    with pytest.raises(ValueError, match="dtype.*'int8'"):
        load_hf_checkpoint(folder, dtype="int8")


def test_param_sharding_places_every_param(single) -> None:
    device = jax.devices()[0]
    seen = []

    def sharding(path: tuple[str, ...]) -> jax.sharding.Sharding:
        seen.append(path)
        return jax.sharding.SingleDeviceSharding(device)

    ckpt = load_hf_checkpoint(single, param_sharding=sharding)
    paths = [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(ckpt.params)]
    assert sorted(seen) == sorted(paths) and ("layers_1", "attn", "q_proj") in seen
    assert all(
        x.sharding == jax.sharding.SingleDeviceSharding(device)
        for x in jax.tree_util.tree_leaves(ckpt.params)
    )
