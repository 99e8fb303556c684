"""Orbax checkpoints: conversion round trip, atomicity, refusal of unfinished folders, named
errors for missing or mis-shaped arrays, and the `jaxserve convert` command.

(Restoring into tensor-parallel shardings is checked in tests/runner/test_tensor_parallel.py,
which has several devices.)"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams, cli
from jaxserve.checkpoints_tools import convert as convert_module
from jaxserve.checkpoints_tools import load_checkpoint, orbax_checkpoint
from jaxserve.checkpoints_tools.convert import convert_hf_to_orbax
from jaxserve.checkpoints_tools.orbax_checkpoint import MARKER_FILE, PARAMS_DIR, save_params

pytest.importorskip("torch")
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint  # noqa: E402

ENGINE = dict(
    block_size=8, num_kv_blocks=8, max_num_seqs=2, max_num_batched_tokens=16, warmup=False
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf"), "qwen3", head_dim=32)


@pytest.fixture(scope="module")
def orbax_dir(hf_dir, tmp_path_factory) -> pathlib.Path:
    return convert_hf_to_orbax(hf_dir, tmp_path_factory.mktemp("out") / "orbax")


def _params_equal(a, b) -> bool:
    same = jax.tree_util.tree_map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)
    return all(jax.tree_util.tree_leaves(same))


def test_conversion_round_trip(hf_dir, orbax_dir):
    files = sorted(p.name for p in orbax_dir.iterdir())
    assert files == sorted(
        [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            PARAMS_DIR,
            MARKER_FILE,
        ]
    )
    marker = json.loads((orbax_dir / MARKER_FILE).read_text())
    assert marker["format"] == "jaxserve-orbax" and marker["dtype"] == "float32"
    hf, orbax = load_checkpoint(hf_dir), load_checkpoint(orbax_dir)
    assert orbax.arch == hf.arch and orbax.eos_token_ids == hf.eos_token_ids
    assert _params_equal(orbax.params, hf.params)
    # No stray staging folder next to the output.
    assert [p.name for p in orbax_dir.parent.iterdir()] == ["orbax"]


def test_a_checkpoint_of_an_older_format_version_is_refused(orbax_dir, tmp_path):
    """Version 1 stored lm_head as [D, V]: loading it would mis-shape (or, when D == V,
    silently transpose) the logits, so the marker's version is checked first."""
    old = tmp_path / "v1"
    shutil.copytree(orbax_dir, old)
    marker = json.loads((old / MARKER_FILE).read_text())
    (old / MARKER_FILE).write_text(json.dumps({**marker, "version": 1}))
    with pytest.raises(ValueError, match=r"version 2, got 'jaxserve-orbax' version 1; convert"):
        load_checkpoint(old)


@pytest.mark.slow
def test_orbax_gives_the_same_tokens_as_safetensors(hf_dir, orbax_dir):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = [
        LLM(str(m), **ENGINE).generate("The quick brown fox", params, use_tqdm=False)[0]
        for m in (hf_dir, orbax_dir)
    ]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].text == outs[1].outputs[0].text  # the tokenizer came along


def test_dtype_is_stored_and_cast_on_load(hf_dir, tmp_path):
    out = convert_hf_to_orbax(hf_dir, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / MARKER_FILE).read_text())["dtype"] == "bfloat16"
    auto = load_checkpoint(out)
    assert auto.dtype == np.dtype("bfloat16")
    assert auto.params["embed"].dtype == np.dtype("bfloat16")
    f32 = load_checkpoint(out, dtype="float32")
    assert f32.params["layers_0"]["attn"]["q_proj"].dtype == np.float32
    np.testing.assert_array_equal(
        np.asarray(f32.params["embed"]), np.asarray(auto.params["embed"]).astype(np.float32)
    )


def test_existing_output_is_kept_unless_overwrite(hf_dir, tmp_path):
    out = tmp_path / "orbax"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite"):
        convert_hf_to_orbax(hf_dir, out)
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]
    convert_hf_to_orbax(hf_dir, out, overwrite=True)
    assert (out / MARKER_FILE).is_file() and not (out / "precious.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["orbax"]  # the old one is gone, not aside


def test_failed_conversion_leaves_nothing(hf_dir, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise KeyboardInterrupt  # e.g. Ctrl-C just before the marker

    monkeypatch.setattr(orbax_checkpoint, "write_marker", fail)
    with pytest.raises(KeyboardInterrupt):
        convert_hf_to_orbax(hf_dir, tmp_path / "orbax")
    assert list(tmp_path.iterdir()) == []


_KILLED_CONVERSION = """
import os, signal, sys
from jaxserve.checkpoints_tools import convert, orbax_checkpoint
def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)  # the params are on disk, the marker is not
orbax_checkpoint.write_marker = killed
convert.convert_hf_to_orbax(sys.argv[1], sys.argv[2])
"""


def test_killed_conversion_is_never_taken_for_a_finished_one(hf_dir, tmp_path):
    out = tmp_path / "orbax"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_CONVERSION, str(hf_dir), str(out)],
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not out.exists()
    (staged,) = tmp_path.iterdir()
    assert staged.name.startswith(".orbax.converting-") and (staged / PARAMS_DIR).is_dir()
    for model in (staged, shutil.copytree(staged, tmp_path / "copied")):
        with pytest.raises(ValueError, match=rf"incomplete Orbax checkpoint: {MARKER_FILE}"):
            load_checkpoint(model)
        with pytest.raises(ValueError, match="incomplete Orbax checkpoint"):
            LLM(str(model), **ENGINE)


def _tampered(orbax_dir: pathlib.Path, tmp_path: pathlib.Path, change) -> pathlib.Path:
    """A copy of orbax_dir whose params were rewritten after change(params)."""
    copy = shutil.copytree(orbax_dir, tmp_path / "tampered")
    params = jax.tree_util.tree_map(np.asarray, load_checkpoint(orbax_dir).params)
    change(params)
    shutil.rmtree(copy / PARAMS_DIR)
    save_params(params, copy / PARAMS_DIR)
    return copy


def test_missing_array_is_named(orbax_dir, tmp_path):
    folder = _tampered(orbax_dir, tmp_path, lambda p: p["layers_1"]["mlp"].pop("up_proj"))
    with pytest.raises(ValueError, match=r"missing array 'layers_1/mlp/up_proj' in .*tampered"):
        load_checkpoint(folder)


def test_misshaped_array_is_named(orbax_dir, tmp_path):
    def shrink(params):
        params["layers_0"]["attn"]["k_proj"] = params["layers_0"]["attn"]["k_proj"][:, :1]

    folder = _tampered(orbax_dir, tmp_path, shrink)
    with pytest.raises(
        ValueError, match=r"array 'layers_0/attn/k_proj' .* has shape \(64, 1, 32\), expected"
    ):
        load_checkpoint(folder)


def test_unexpected_array_is_named(orbax_dir, tmp_path):
    folder = _tampered(orbax_dir, tmp_path, lambda p: p.update(extra=np.zeros(3, np.float32)))
    with pytest.raises(ValueError, match="unexpected array 'extra'"):
        load_checkpoint(folder)


def test_cli_convert(hf_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli.main(["convert", "--model", str(hf_dir), "--output", str(out)]) == 0
    assert (out / MARKER_FILE).is_file()
    assert cli.main(["convert", "--model", str(hf_dir), "--output", str(out)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    args = ["--model", str(hf_dir), "--output", str(out), "--overwrite", "--dtype", "float16"]
    assert convert_module.main(args) == 0
    assert json.loads((out / MARKER_FILE).read_text())["dtype"] == "float16"
    missing = ["convert", "--model", str(tmp_path / "nope"), "--output", str(tmp_path / "new")]
    assert cli.main(missing) == 2
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_module_entry_point_help():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.checkpoints_tools.convert", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert proc.returncode == 0 and "--output" in proc.stdout
