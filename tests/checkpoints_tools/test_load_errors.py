"""A missing model folder or a bad config.json: one FileNotFoundError / ValueError / TypeError
naming the path (and the key), from every entry point, before any weight is read."""

from __future__ import annotations

import json
import pathlib

import pytest

from jaxserve.checkpoints_tools import load_arch, load_checkpoint, load_hf_checkpoint
from jaxserve.checkpoints_tools.orbax_checkpoint import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MARKER_FILE,
    PARAMS_DIR,
)

# Enough for arch_config_from_hf: every test breaks one thing of it.
CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
)
ENTRY_POINTS = [load_checkpoint, load_arch, load_hf_checkpoint]


def _folder(tmp_path: pathlib.Path, config: bytes | str, orbax: bool = False) -> pathlib.Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_bytes(config if isinstance(config, bytes) else config.encode())
    if orbax:  # a finished Orbax conversion, as far as the checks before config.json go
        marker = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "dtype": "float32"}
        (folder / MARKER_FILE).write_text(json.dumps(marker))
        (folder / PARAMS_DIR).mkdir()
    return folder


@pytest.mark.parametrize("load", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_missing_folder_is_named(load, tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load(missing)


@pytest.mark.parametrize("load", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_missing_config_is_named(load, tmp_path) -> None:
    (tmp_path / "model").mkdir()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "model" / "config.json")):
        load(tmp_path / "model")


BAD_CONFIGS = {
    "malformed-json": ("{", ValueError, "malformed JSON"),
    "not-utf8": (b"\xff\xfe\x00garbage", ValueError, "not UTF-8 text"),
    "a-list": ("[1, 2]", ValueError, "expected a JSON object, got list"),
    "zero-heads": (
        json.dumps({**CONFIG, "num_attention_heads": 0}),
        ValueError,
        "num_attention_heads must be >= 1, got 0",
    ),
    "null-heads": (
        json.dumps({**CONFIG, "num_attention_heads": None}),
        TypeError,
        "num_attention_heads must be an int, got None",
    ),
    "string-eps": (
        json.dumps({**CONFIG, "rms_norm_eps": "1e-5"}),
        TypeError,
        "rms_norm_eps must be a number",
    ),
}


# (entry point, whether the folder is an Orbax conversion): load_hf_checkpoint reads HF only.
WHERE = [(load, False) for load in ENTRY_POINTS] + [(load_checkpoint, True), (load_arch, True)]


@pytest.mark.parametrize(
    "load, orbax", WHERE, ids=[f"{f.__name__}-{'orbax' if o else 'hf'}" for f, o in WHERE]
)
@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_is_named(case, load, orbax, tmp_path) -> None:
    config, error, message = BAD_CONFIGS[case]
    folder = _folder(tmp_path, config, orbax=orbax)
    with pytest.raises(error) as raised:
        load(folder)
    assert type(raised.value) is error
    assert str(raised.value).startswith(f"{folder / 'config.json'}: ")
    assert message in str(raised.value)


def test_a_config_dtype_jaxserve_does_not_run_is_warned_about_once(tmp_path, caplog) -> None:
    """torch_dtype "int8" runs in float32 (the documented fallback), now with one warning naming
    the key and the fallback (issue 29, item 17); an explicit dtype needs no word."""
    import logging

    import numpy as np

    from jaxserve.checkpoints_tools.load import declared_dtype
    from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint

    folder = write_tiny_hf_checkpoint(tmp_path / "int8", "llama", with_tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None)
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "int8"}))
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        ckpt = load_hf_checkpoint(folder)
    assert ckpt.dtype == np.float32
    (record,) = [r for r in caplog.records if "dtype" in r.getMessage()]
    assert "torch_dtype='int8'" in record.getMessage() and "float32" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert declared_dtype(folder) == "int8"  # the engine's plan reads it (and warns) once
        assert len(caplog.records) == 1
        load_hf_checkpoint(folder, dtype="bfloat16")  # what the engine then loads with
    assert len(caplog.records) == 1
