"""The C++ row kernel (cpu_rows.cc) on its own: its skip_rows contract, bad data in the index
arrays, building and the switch that turns it off. Its numbers against the reference are in
test_rpa_kernels.py (the shared grid) and test_rpa_chunked.py (random batches)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import cpu_ffi
from jaxserve.pallas_kernels.ragged_paged_attention import cpu_rows
from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
)
from jaxserve.pallas_kernels.ragged_paged_attention.testing import random_batch

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))


@pytest.fixture
def kernel() -> None:
    # Built on first use, at run time: collecting the tests builds nothing.
    if not cpu_rows.available():
        pytest.skip(f"C++ kernel unavailable: {cpu_rows.unavailable_reason()}")


needs_kernel = pytest.mark.usefixtures("kernel")
SCALE = 0.25
OPTIONS = dict(sm_scale=SCALE, sliding_window=None, soft_cap=None)


def _batch(seqs, seed=0, num_tokens=24, num_slots=6):
    return random_batch(
        seqs, num_tokens=num_tokens, num_slots=num_slots, table_width=8, num_q_heads=4,
        num_kv_heads=2, head_dim=16, page_size=4, rng=np.random.default_rng(seed),
    )  # fmt: skip


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_builds_where_a_compiler_exists() -> None:
    assert cpu_rows.available(), cpu_rows.unavailable_reason()


@needs_kernel
def test_skipped_rows_and_padding_are_zero_the_rest_match_the_reference() -> None:
    seqs = [(5, 9), (1, 30), (3, 3)]
    args = _batch(seqs)
    skip = jnp.asarray([2, 0, 3, 0, 0, 0], jnp.int32)  # rows 0-1 and 6-8 left to the caller
    got = np.asarray(cpu_rows.cpu_rows_attention(*args, skip, **OPTIONS))
    want = np.asarray(ragged_paged_attention_reference(*args, sm_scale=SCALE))
    computed = [2, 3, 4, 5]
    np.testing.assert_allclose(got[computed], want[computed], atol=1e-5, rtol=1e-5)
    assert not got[[0, 1, 6, 7, 8]].any() and not got[9:].any()


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("head_dim", [8, 16, 24, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_every_head_dim_and_group_matches_the_reference(head_dim: int, group: int) -> None:
    """Head dims that are a multiple of 16 take the vector path (query heads in blocks of
    four, or two from 128 up, then single heads for the rest of the group), others plain
    loops; decodes and multi-row chunks (past one work item's 8 rows) over partial pages,
    with and without a sliding window and a soft cap."""
    seqs = [(1, 37), (12, 40), (3, 3), (1, 1), (9, 20)]
    args = random_batch(
        seqs, num_tokens=32, num_slots=6, table_width=6, num_q_heads=2 * group,
        num_kv_heads=2, head_dim=head_dim, page_size=8, rng=np.random.default_rng(head_dim),
    )  # fmt: skip
    skip = jnp.zeros((6,), jnp.int32)
    rows = int(args[5][len(seqs)])
    scale = head_dim**-0.5
    for window, cap in [(None, None), (7, None), (None, 5.0)]:
        got = np.asarray(cpu_rows.cpu_rows_attention(
            *args, skip, sm_scale=scale, sliding_window=window, soft_cap=cap))  # fmt: skip
        want = np.asarray(ragged_paged_attention_reference(
            *args, sm_scale=scale, sliding_window=window, soft_cap=cap))  # fmt: skip
        np.testing.assert_allclose(got[:rows], want[:rows], atol=2e-5, rtol=2e-5,
                                   err_msg=f"window={window} cap={cap}")  # fmt: skip
        assert not got[rows:].any()


@needs_kernel
def test_out_of_range_indices_never_read_outside_the_pages() -> None:
    """Block ids past S or negative, kv_lens past the table's width or below q_len, cu_q_lens
    past T, num_seqs past R: the call returns finite numbers (values of such rows are
    unspecified, as for the other backends) instead of reading foreign memory."""
    q, k, v, kv_lens, tables, cu, num_seqs = _batch([(2, 6), (1, 5)])
    tables = tables.at[0, :3].set(jnp.asarray([10**6, -5, 2**31 - 1], jnp.int32))
    kv_lens = kv_lens.at[1].set(10**6).at[2].set(-7)
    cu = cu.at[3:].set(10**6)
    num_seqs = jnp.asarray([99], jnp.int32)
    skip = jnp.asarray([0, -3, 10**6, 0, 0, 0], jnp.int32)
    got = np.asarray(cpu_rows.cpu_rows_attention(q, k, v, kv_lens, tables, cu, num_seqs, skip,
                                                 **OPTIONS))  # fmt: skip
    assert np.isfinite(got).all()


def test_switch_off_falls_back_to_xla() -> None:
    """JAXSERVE_CPU_KERNEL=0: nothing is built and "auto" on CPU is the xla backend."""
    code = (
        "from jaxserve.pallas_kernels.ragged_paged_attention import cpu_rows, Target, "
        "select_attention; "
        "t = Target('cpu', 'float32', num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=8); "
        "print(cpu_rows.available(), cpu_rows.unavailable_reason(), "
        "select_attention('auto', t)[0].name)"
    )
    env = dict(os.environ, JAXSERVE_CPU_KERNEL="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "disabled", "by", "JAXSERVE_CPU_KERNEL=0", "xla"]


def test_a_missing_compiler_is_reported(monkeypatch) -> None:
    monkeypatch.setattr(cpu_ffi, "compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C.. compiler found"):
        cpu_ffi.build(cpu_rows.KERNEL.source)


def test_a_failing_build_reports_the_compiler_error(monkeypatch, tmp_path) -> None:
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++;\n")
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler on this machine")
    with pytest.raises(RuntimeError, match="failed:\n.*error"):
        cpu_ffi.build(bad)
    assert not list((tmp_path / "cache").glob("*.so")), "no partial library is left behind"


def test_explicit_cpu_backend_is_refused_where_it_cannot_run(monkeypatch) -> None:
    """attention_backend="cpu" fails up front (before a model is built) off the CPU platform
    and where the kernel cannot be built (with the reason); "auto" then takes the xla
    backend."""
    from jaxserve.pallas_kernels.ragged_paged_attention import Target, select_attention

    shapes = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=8)
    with pytest.raises(ValueError, match="cpu runs on cpu, not on gpu"):
        select_attention("cpu", Target("gpu", "float32", gpu_generation="hopper", **shapes))
    monkeypatch.setattr(cpu_rows.KERNEL, "load", lambda: "no compiler in this test")
    on_cpu = Target("cpu", "float32", **shapes)
    with pytest.raises(ValueError, match="does not build here \\(no compiler in this test\\)"):
        select_attention("cpu", on_cpu)
    assert select_attention("auto", on_cpu)[0].name == "xla"
