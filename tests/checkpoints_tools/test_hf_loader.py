"""load_hf_checkpoint on real folders written by transformers: layouts, dtypes, bad input."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxserve.checkpoints_tools.hf_loader as hf_loader
import jaxserve.checkpoints_tools.safetensors_index as safetensors_index
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


@pytest.mark.parametrize(
    "np_dtype, header_dtype", [(np.int32, "I32"), (np.int64, "I64"), (np.bool_, "BOOL")]
)
def test_non_float_tensor_is_refused_with_its_dtype(
    single, copy_of, no_placement, np_dtype, header_dtype
) -> None:
    """An integer or boolean weight used to be cast to float without a word."""
    folder = copy_of(single)
    _rewrite(folder / "model.safetensors", lambda t: t.__setitem__(NAME, t[NAME].astype(np_dtype)))
    with pytest.raises(
        ValueError,
        match=rf"tensor '{NAME}' in .*model\.safetensors has dtype {header_dtype}; only "
        r"floating-point weights \(F16, BF16, F32, F64\)",
    ):
        load_hf_checkpoint(folder)


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_checkpoint_is_refused_as_unsupported(single, copy_of, no_placement, fp8) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    folder = copy_of(single)
    tensors = load_torch(str(folder / "model.safetensors"))
    tensors[NAME] = tensors[NAME].to(getattr(torch, fp8))
    # As in real FP8 checkpoints: a scale the model does not know, which must not be the error.
    tensors[NAME + "_scale_inv"] = torch.ones(1)
    save_torch(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=rf"'{NAME}' in .*model\.safetensors has dtype F8_E\dM\d, but config.json "
        "declares no FP8 quantization_config",
    ):
        load_hf_checkpoint(folder)


def test_float_dtypes_are_cast(single, copy_of) -> None:
    folder = copy_of(single)
    other = "model.layers.0.self_attn.q_proj.weight"

    def mix(t):
        t[NAME] = t[NAME].astype(np.float64)
        t[other] = t[other].astype(np.float16)

    _rewrite(folder / "model.safetensors", mix)
    ckpt, ref = load_hf_checkpoint(folder), load_hf_checkpoint(single)
    assert all(x.dtype == np.float32 for x in jax.tree_util.tree_leaves(ckpt.params))
    up = ("layers_1", "mlp", "up_proj")
    np.testing.assert_array_equal(
        np.asarray(ckpt.params[up[0]][up[1]][up[2]]), np.asarray(ref.params[up[0]][up[1]][up[2]])
    )


def _poison(folder: pathlib.Path, names: list[str]) -> None:
    def edit(t):
        for i, name in enumerate(names):
            t[name] = t[name].copy()
            t[name].flat[i] = np.nan if i % 2 == 0 else -np.inf

    _rewrite(folder / "model.safetensors", edit)


NON_FINITE = [
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.self_attn.k_proj.weight",
    "model.norm.weight",
]


def test_non_finite_weights_warn_once_naming_them(single, copy_of, caplog) -> None:
    folder = copy_of(single)
    _poison(folder, NON_FINITE)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        ckpt = load_hf_checkpoint(folder)
    (record,) = [r for r in caplog.records if r.name == "jaxserve"]
    message = record.getMessage()
    assert message.startswith("3 tensor(s) hold NaN or Inf values as loaded in float32")
    for name in NON_FINITE:
        assert f"'{name}' ({folder / 'model.safetensors'})" in message
    assert not np.isfinite(np.asarray(ckpt.params["final_norm"]["scale"])).all()  # loaded as is
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        load_hf_checkpoint(single)
    assert not [r for r in caplog.records if r.name == "jaxserve"]


def test_non_finite_warning_names_a_few_and_counts_all(single, copy_of, caplog) -> None:
    folder = copy_of(single)
    names = [
        f"model.layers.{i}.{p}.weight"
        for i in (0, 1)
        for p in ("mlp.up_proj", "mlp.down_proj", "self_attn.q_proj", "self_attn.o_proj")
    ]
    _poison(folder, names)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        load_hf_checkpoint(folder)
    (record,) = [r for r in caplog.records if r.name == "jaxserve"]
    message = record.getMessage()
    assert message.startswith("8 tensor(s)") and "and 3 more" in message
    assert sum(name in message for name in names) == hf_loader.MAX_NAMED_NON_FINITE


def test_float32_overflowing_float16_is_reported(single, copy_of, caplog) -> None:
    folder = copy_of(single)
    _rewrite(folder / "model.safetensors", lambda t: t[NAME].__setitem__((0, 0), 1e6))
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        load_hf_checkpoint(folder, dtype="float32")
        assert not [r for r in caplog.records if r.name == "jaxserve"]
        load_hf_checkpoint(folder, dtype="float16")
    (record,) = [r for r in caplog.records if r.name == "jaxserve"]
    assert "as loaded in float16" in record.getMessage() and NAME in record.getMessage()


def test_finiteness_is_fetched_once_not_per_tensor(single, copy_of, monkeypatch) -> None:
    """The check runs on device; its booleans come back in one fetch at the end."""
    folder = copy_of(single)
    _poison(folder, NON_FINITE[:1])
    fetches = []
    real_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: fetches.append(x) or real_get(x))
    load_hf_checkpoint(
        folder, param_sharding=lambda path: jax.sharding.SingleDeviceSharding(jax.devices()[0])
    )
    (fetched,) = fetches
    assert len(fetched) == len(jax.tree_util.tree_leaves(load_hf_checkpoint(single).params))


_SHARDED_LOAD = """
import json, logging, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxserve.checkpoints_tools import load_hf_checkpoint
assert jax.device_count() == 2, jax.devices()
records = []
logging.getLogger("jaxserve").addHandler(logging.Handler())
logging.getLogger("jaxserve").handlers[-1].emit = lambda r: records.append(r.getMessage())
mesh = Mesh(np.array(jax.devices()), ("tp",))
def sharding(path):  # the embedding and the MLP split over both devices, the rest replicated
    split = path == ("embed",) or path[-1] in ("up_proj", "gate_proj")
    return NamedSharding(mesh, P("tp") if split else P())
ckpt = load_hf_checkpoint(sys.argv[1], param_sharding=sharding)
shards = len(ckpt.params["embed"].sharding.device_set)
print(json.dumps({"records": records, "embed_devices": shards}))
"""


def test_non_finite_check_works_on_sharded_params(single, copy_of) -> None:
    """Tensor-parallel loading places params with a NamedSharding over several devices."""
    folder = copy_of(single)
    _poison(folder, ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"])
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED_LOAD, str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["embed_devices"] == 2
    (message,) = out["records"]
    assert message.startswith("2 tensor(s)") and "model.embed_tokens.weight" in message


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated data
        lambda b: b[:20],  # truncated header
        lambda b: b"",  # empty
        lambda b: b"\xff" * 64,  # not safetensors at all
    ],
    ids=["truncated-data", "truncated-header", "empty", "garbage"],
)
def test_corrupt_safetensors_file_is_named(single, copy_of, no_placement, damage) -> None:
    folder = copy_of(single)
    file = folder / "model.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(ValueError, match=rf"{file}: not a readable safetensors file \(.+\)"):
        load_hf_checkpoint(folder)


def test_corrupt_shard_is_named(sharded, copy_of, no_placement) -> None:
    folder = copy_of(sharded)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"{shard}: not a readable safetensors file"):
        load_hf_checkpoint(folder)


def test_file_damaged_after_the_header_scan_is_named(single, copy_of, monkeypatch) -> None:
    folder = copy_of(single)
    file = folder / "model.safetensors"
    real_scan = hf_loader.scan_headers

    def scan_then_truncate(files):
        found = real_scan(files)
        file.write_bytes(file.read_bytes()[:-100])  # e.g. a copy still in progress
        return found

    monkeypatch.setattr(hf_loader, "scan_headers", scan_then_truncate)
    with pytest.raises(ValueError, match=rf"{file}: not a readable safetensors file"):
        load_hf_checkpoint(folder)


def test_tensor_read_error_names_tensor_and_file(single, copy_of, monkeypatch) -> None:
    from safetensors import SafetensorError

    real_open = safetensors_index.safe_open
    reads = []

    class FailingRead:
        """A safetensors handle whose data reads fail (an I/O error) after the header scan."""

        def __init__(self, *args, **kwargs):
            self._inner = real_open(*args, **kwargs)

        def __enter__(self):
            self._f = self._inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self._inner.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def get_tensor(self, name):
            reads.append(name)
            raise SafetensorError("Input/output error")

    monkeypatch.setattr(safetensors_index, "safe_open", FailingRead)
    with pytest.raises(ValueError) as raised:
        load_hf_checkpoint(single)
    (name,) = reads
    assert str(raised.value) == (
        f"{single / 'model.safetensors'}: cannot read tensor {name!r} (Input/output error)"
    )
