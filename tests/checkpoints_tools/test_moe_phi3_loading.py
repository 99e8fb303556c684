"""Loading Mixtral's per-expert tensors (stacked into one param each) and Phi-3's fused
projections (split into q/k/v and gate/up), checked value by value against the safetensors,
then through `jaxserve convert` and the Orbax loader; the errors name the expert tensor."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.checkpoints_tools import load_checkpoint, load_hf_checkpoint
from jaxserve.checkpoints_tools.convert import convert_hf_to_orbax

pytest.importorskip("torch")
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint  # noqa: E402

D, E, F_EXPERT, F_DENSE, N, K, H = 64, 4, 32, 128, 4, 2, 16


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("mixtral"), "mixtral")


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("phi3"), "phi3")


def _params(ckpt) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(ckpt.params)[0]
    return {"/".join(k.key for k in path): np.asarray(v) for path, v in flat}


def test_mixtral_experts_are_stacked(mixtral_dir):
    hf = load_file(mixtral_dir / "model.safetensors")
    params = _params(load_hf_checkpoint(mixtral_dir, dtype="float32"))
    for i in range(2):
        moe, block = f"layers_{i}/moe/", f"model.layers.{i}.block_sparse_moe."
        assert params[moe + "router"].shape == (D, E)
        np.testing.assert_array_equal(params[moe + "router"], hf[block + "gate.weight"].T)
        for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            stacked = params[f"{moe}experts_{ours}"]
            assert stacked.shape == ((E, F_EXPERT, D) if ours == "down" else (E, D, F_EXPERT))
            for e in range(E):
                w = hf[f"{block}experts.{e}.{theirs}.weight"]
                np.testing.assert_array_equal(stacked[e], w.T)
    assert not any("/mlp/" in name for name in params)  # every Mixtral layer is MoE


def test_experts_split_over_shards_load_the_same(mixtral_dir, tmp_path):
    """A stacked param whose experts lie in several safetensors files (12 shards here)."""
    sharded = write_tiny_hf_checkpoint(tmp_path, "mixtral", max_shard_size="40KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    single = _params(load_hf_checkpoint(mixtral_dir, dtype="float32"))
    got = _params(load_hf_checkpoint(sharded, dtype="float32"))
    assert sorted(got) == sorted(single)
    for name, value in single.items():
        np.testing.assert_array_equal(got[name], value)


def test_phi3_fused_projections_are_split(phi3_dir):
    hf = load_file(phi3_dir / "model.safetensors")
    params = _params(load_hf_checkpoint(phi3_dir, dtype="float32"))
    qkv = hf["model.layers.0.self_attn.qkv_proj.weight"]  # [(N + 2K) * H, D]
    q, k, v = np.split(qkv, [N * H, (N + K) * H])
    np.testing.assert_array_equal(params["layers_0/attn/q_proj"], q.T.reshape(D, N, H))
    np.testing.assert_array_equal(params["layers_0/attn/k_proj"], k.T.reshape(D, K, H))
    np.testing.assert_array_equal(params["layers_0/attn/v_proj"], v.T.reshape(D, K, H))
    gate, up = np.split(hf["model.layers.0.mlp.gate_up_proj.weight"], 2)  # [2F, D]
    np.testing.assert_array_equal(params["layers_0/mlp/gate_proj"], gate.T)
    np.testing.assert_array_equal(params["layers_0/mlp/up_proj"], up.T)
    assert params["layers_0/mlp/down_proj"].shape == (F_DENSE, D)


@pytest.mark.parametrize("folder", ["mixtral_dir", "phi3_dir"])
def test_convert_round_trip(folder, request, tmp_path):
    hf_dir = request.getfixturevalue(folder)
    expected = _params(load_hf_checkpoint(hf_dir, dtype="bfloat16"))
    out = convert_hf_to_orbax(hf_dir, tmp_path / "orbax", dtype="bfloat16")
    restored = load_checkpoint(str(out))
    got = _params(restored)
    assert restored.arch == load_hf_checkpoint(hf_dir, dtype="float32").arch
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype
        np.testing.assert_array_equal(got[name], value)


def _rewrite(src, dst, edit) -> None:
    """Copy the checkpoint folder src to dst with its tensors passed through edit(dict)."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_text((src / name).read_text())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")


def test_expert_tensor_errors_are_named(mixtral_dir, tmp_path):
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    _rewrite(mixtral_dir, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        load_hf_checkpoint(tmp_path / "missing")
    bad = lambda t: t | {name: np.zeros((D, F_EXPERT + 1), np.float32)}
    _rewrite(mixtral_dir, tmp_path / "shape", bad)
    with pytest.raises(ValueError, match=rf"'{name}' .* shape \(64, 33\), expected \(64, 32\)"):
        load_hf_checkpoint(tmp_path / "shape")
    extra = "model.layers.0.block_sparse_moe.experts.4.w1.weight"  # a fifth expert
    _rewrite(mixtral_dir, tmp_path / "extra", lambda t: t | {extra: t[name.replace("w2", "w1")]})
    with pytest.raises(ValueError, match=f"unexpected tensor '{extra}'"):
        load_hf_checkpoint(tmp_path / "extra")


def test_non_finite_expert_is_named(mixtral_dir, tmp_path, caplog):
    name = "model.layers.0.block_sparse_moe.experts.2.w3.weight"

    def poison(tensors):
        w = tensors[name].copy()
        w[0, 0] = np.nan
        return tensors | {name: w}

    _rewrite(mixtral_dir, tmp_path / "nan", poison)
    with caplog.at_level("WARNING", logger="jaxserve"):
        load_hf_checkpoint(tmp_path / "nan")
    assert name in caplog.text and "1 tensor(s)" in caplog.text
