"""Backend selection of the dispatcher, and every backend through it on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import rpa_cases as cases

from jaxserve.pallas_kernels.ragged_paged_attention import (
    BACKENDS,
    cpu_rows,
    default_attention_backend,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    resolve_backend,
)


@pytest.mark.parametrize(
    ("platform", "backend"), [("gpu", "pallas"), ("cuda", "pallas"), ("tpu", "pallas")]
)
def test_default_backend_per_platform(platform: str, backend: str) -> None:
    assert default_attention_backend(platform) == backend


def test_default_backend_here_is_the_cpu_kernel_where_it_builds() -> None:
    want = "cpu" if cpu_rows.available() else "xla"
    assert default_attention_backend() == default_attention_backend("cpu") == want


def test_cpu_backend_refuses_other_platforms() -> None:
    with pytest.raises(ValueError, match="runs on the cpu platform only, not 'gpu'"):
        resolve_backend("cpu", "gpu")


@pytest.mark.parametrize(
    ("backend", "platform", "resolved"),
    [
        ("reference", "gpu", ("reference", False)),
        ("cpu", "cpu", ("cpu", False)),
        ("pallas", "gpu", ("gpu", False)),
        ("pallas", "tpu", ("tpu", False)),
        ("pallas", "cpu", ("gpu", True)),
        ("pallas_gpu", "gpu", ("gpu", False)),
        ("pallas_gpu", "tpu", ("gpu", True)),
        ("pallas_tpu", "tpu", ("tpu", False)),
        ("pallas_tpu", "cpu", ("tpu", True)),
    ],
)
def test_resolve_backend(backend: str, platform: str, resolved: tuple[str, bool]) -> None:
    assert resolve_backend(backend, platform) == resolved


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_matches_reference_on_cpu(backend: str) -> None:
    shape = cases.SHAPES[2]
    args = cases.make_inputs(shape, cases.batch("mixed", shape.page_size), seed=3)
    options = dict(sm_scale=cases.sm_scale(shape), sliding_window=9, soft_cap=3.0)
    want = ragged_paged_attention_reference(*args, **options)
    got = ragged_paged_attention(*args, **options, backend=backend)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
