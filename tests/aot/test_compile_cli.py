"""`jaxserve compile`'s bad input: exit status 2 and a message that names what is wrong (the
known targets, the device count, what to install for a missing compiler). None of these needs
a TPU compiler: each is refused before anything is compiled."""

from __future__ import annotations

import importlib.util

import pytest
from tiny_config import write_tiny_llama

from jaxserve.aot import devices
from jaxserve.aot.targets import get_target
from jaxserve.cli import main


@pytest.fixture(autouse=True)
def _no_mds_query(monkeypatch) -> None:
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")  # restored after each test


def _compile(capsys, *args: str) -> tuple[int, str]:
    rc = main(["compile", *args])
    return rc, capsys.readouterr().err


def test_an_unknown_target_exits_2_listing_the_known_ones(tmp_path, capsys) -> None:
    rc, err = _compile(capsys, "--model", write_tiny_llama(tmp_path), "--target", "v9-1")
    assert rc == 2
    assert "--target must be one of h100, h200, a100-80g, l4, v5e-1, v5e-4" in err
    assert "got 'v9-1'" in err


def test_more_devices_than_the_target_has_exits_2(tmp_path, capsys) -> None:
    model = write_tiny_llama(tmp_path)
    rc, err = _compile(capsys, "--model", model, "--target", "v5e-4", "--tensor-parallel-size", "8")
    assert rc == 2 and "between 1 and the 4 chips of v5e-4, got 8" in err


def _without(monkeypatch, *modules: str) -> None:
    """As if ``modules`` were not installed (devices.compiler_missing looks them up)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        devices.importlib.util, "find_spec", lambda n, *a: None if n in modules else real(n, *a)
    )


def test_a_gpu_target_without_its_compiler_says_what_to_install(tmp_path, capsys, monkeypatch):
    _without(monkeypatch, *devices.CUDA_PLUGINS)
    rc, err = _compile(capsys, "--model", write_tiny_llama(tmp_path), "--target", "h100")
    assert rc == 2 and "compiling for h100 needs the CUDA compiler" in err
    assert 'pip install "jaxserve[cuda12]"' in err and "jax[cuda12]==" in err


def test_a_tpu_target_without_libtpu_says_what_to_install(tmp_path, capsys, monkeypatch) -> None:
    _without(monkeypatch, "libtpu")
    assert "libtpu" in devices.compiler_missing(get_target("v6e-1"))
    rc, err = _compile(capsys, "--model", write_tiny_llama(tmp_path), "--target", "v6e-1")
    assert rc == 2
    assert (
        'needs the TPU compiler (libtpu), which is not installed: pip install "jaxserve[tpu]"'
        in err
    )
    assert "jax[tpu]==" in err


def test_a_missing_model_exits_2(tmp_path, capsys) -> None:
    rc, err = _compile(capsys, "--model", str(tmp_path / "nothing"), "--target", "v6e-1")
    assert rc == 2 and "nothing" in err


@pytest.mark.parametrize("buckets", ["x", "0", ""])
def test_bad_token_buckets_exit_2(tmp_path, capsys, buckets) -> None:
    with pytest.raises(SystemExit) as e:
        main(["compile", "--model", str(tmp_path), "--target", "v6e-1", "--token-buckets", buckets])
    assert e.value.code == 2
    assert "--token-buckets" in capsys.readouterr().err
