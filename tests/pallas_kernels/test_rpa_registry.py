"""The registry of attention implementations: what "auto" picks on each platform and chip,
why the others are refused, explicit names that cannot run, tensor-parallel head splits, and
every name through the by-name entry point on this CPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import rpa_cases as cases

from jaxserve.pallas_kernels.ragged_paged_attention import (
    BACKENDS,
    AttentionImpl,
    Target,
    cpu_rows,
    gpu_generation,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    runnable_names,
    select_attention,
)
from jaxserve.pallas_kernels.ragged_paged_attention.impl import head_split_refusal
from jaxserve.pallas_kernels.ragged_paged_attention.kernels import mosaic_gpu_kernel
from jaxserve.pallas_kernels.ragged_paged_attention.target import (
    AMPERE,
    BLACKWELL,
    HOPPER,
    OLDER_GPU,
)

LLAMA = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
CPU_KERNEL = "cpu or xla"  # "cpu" where its C++ kernel builds, else "xla" (run time)
MOSAIC_GPU = mosaic_gpu_kernel() is not None


def target(platform: str, dtype: str = "bfloat16", **kw) -> Target:
    return Target(platform=platform, dtype=dtype, **(LLAMA | kw))


@pytest.mark.parametrize(
    ("compute_capability", "generation"),
    [("9.0", HOPPER), ("10.0", BLACKWELL), ("8.9", AMPERE), ("8.0", AMPERE), ("7.5", OLDER_GPU),
     (None, OLDER_GPU), ("gfx90a", OLDER_GPU)],
)  # fmt: skip
def test_gpu_generation(compute_capability, generation) -> None:
    assert gpu_generation(compute_capability) == generation


@pytest.mark.parametrize(
    ("platform", "generation", "dtype", "want"),
    [
        ("cpu", None, "float32", CPU_KERNEL),
        ("cpu", None, "bfloat16", "xla"),  # the C++ rows take f32 only
        ("tpu", None, "bfloat16", "pallas_tpu"),
        ("gpu", HOPPER, "bfloat16", "pallas_mosaic_gpu" if MOSAIC_GPU else "pallas_triton"),
        ("gpu", BLACKWELL, "bfloat16", "pallas_triton"),  # no WGMMA: not the Mosaic kernel
        ("gpu", AMPERE, "bfloat16", "pallas_triton"),
        ("gpu", OLDER_GPU, "float16", "xla"),
    ],
)
def test_auto_per_platform(platform, generation, dtype, want) -> None:
    if want == CPU_KERNEL:
        want = "cpu" if cpu_rows.available() else "xla"
    impl, refused = select_attention("auto", target(platform, dtype, gpu_generation=generation))
    assert impl.name == want and not impl.interpret
    if want == "xla":  # passed over the platform's kernels, saying why
        assert refused and all("xla" not in r.split(":")[0] for r in refused)


def test_refusals_say_why() -> None:
    _, refused = select_attention("auto", target("cpu", "bfloat16"))
    if cpu_rows.available():
        assert refused == ["cpu takes float32, not bfloat16"]
    _, refused = select_attention("auto", target("gpu", gpu_generation=OLDER_GPU))
    assert (
        "pallas_triton needs a blackwell+ or hopper or ampere-ada GPU; gpu is pre-ampere" in refused
    )


def test_an_explicit_name_that_cannot_run_lists_those_that_can() -> None:
    with pytest.raises(
        ValueError, match=r"'cpu' cannot run here \(cpu runs on cpu, not on gpu"
    ) as e:
        select_attention("cpu", target("gpu", gpu_generation=AMPERE))
    assert "'pallas_triton', 'pallas_gpu', 'pallas'" in str(e.value)
    with pytest.raises(ValueError, match="pallas_mosaic_gpu needs a hopper GPU"):
        select_attention("pallas_mosaic_gpu", target("gpu", gpu_generation=AMPERE))
    with pytest.raises(ValueError, match="attention_backend must be 'auto' or one of"):
        select_attention("cuda", target("gpu", gpu_generation=AMPERE))


@pytest.mark.parametrize("generation", [BLACKWELL, AMPERE])
def test_mosaic_gpu_is_refused_on_gpus_without_wgmma(generation) -> None:
    """The chip is checked when the plan is made, from the Target: the kernel probes nothing."""
    _, refused = select_attention("auto", target("gpu", gpu_generation=generation))
    if generation == BLACKWELL:
        assert f"pallas_mosaic_gpu needs a hopper GPU; gpu is {generation}" in refused
    with pytest.raises(ValueError, match="pallas_mosaic_gpu needs a hopper GPU"):
        select_attention("pallas_mosaic_gpu", target("gpu", gpu_generation=generation))


@pytest.mark.skipif(not MOSAIC_GPU, reason="this jax has no Pallas Mosaic GPU backend")
@pytest.mark.parametrize(("version", "refused"), [(12080, True), (12090, True), (12091, False)])
def test_mosaic_gpu_is_refused_where_ptxas_miscompiles_masks(version, refused) -> None:
    hopper = target("gpu", gpu_generation=HOPPER, cuda_runtime_version=version)
    impl, why = select_attention("auto", hopper)
    if not refused:
        assert impl.name == "pallas_mosaic_gpu" and not why
        return
    assert impl.name == "pallas_triton"
    assert any(f"CUDA runtime {version} found: use CUDA >= 12.9.1" in r for r in why)


def test_pallas_names_run_in_interpret_mode_off_their_platform() -> None:
    impl, _ = select_attention("pallas", target("cpu", "float32"))
    assert (impl.name, impl.interpret) == ("pallas_triton", True)
    impl, _ = select_attention("pallas_tpu", target("cpu", "float32"))
    assert (impl.name, impl.interpret) == ("pallas_tpu", True)
    impl, _ = select_attention("pallas", target("tpu"))
    assert (impl.name, impl.interpret) == ("pallas_tpu", False)
    with pytest.raises(ValueError, match="attention_backend=.pallas_mosaic_gpu. cannot run here"):
        select_attention("pallas_mosaic_gpu", target("cpu", "float32"))
    if MOSAIC_GPU:  # half precision: the Mosaic GPU kernel's own interpret mode
        impl, _ = select_attention("pallas_mosaic_gpu", target("cpu", "bfloat16"))
        assert (impl.name, impl.interpret) == ("pallas_mosaic_gpu", True)
    assert "pallas_tpu" not in runnable_names(target("cpu", "float32"))  # natively only


def test_shapes_a_kernel_cannot_tile_are_refused_by_its_own_validation() -> None:
    # Triton needs a power-of-two head dim >= 16.
    impl, refused = select_attention("auto", target("gpu", gpu_generation=AMPERE, head_dim=80))
    assert impl.name == "xla"
    assert any("pallas_triton: head dim H must be a power of two" in r for r in refused)


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "tp", "splits"),
    [(8, 2, 2, True), (8, 2, 1, True), (8, 2, 4, False), (8, 8, 4, True), (6, 2, 4, True)],
)
def test_head_splits_under_tensor_parallelism(num_q_heads, num_kv_heads, tp, splits) -> None:
    assert (head_split_refusal(num_q_heads, num_kv_heads, tp) is None) == splits
    t = target("tpu", num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, tensor_parallel_size=tp)
    impl, _ = select_attention("auto", t)
    # A split that does not nest leaves the GSPMD-partitioned reference, never silently.
    assert impl.name == ("pallas_tpu" if splits else "reference")
    if not splits:
        with pytest.raises(ValueError, match="splits the 8 query heads but not the 2 KV heads"):
            select_attention("pallas_tpu", t)


def test_implementations_are_static_configuration() -> None:
    a, b = AttentionImpl("xla", "xla"), AttentionImpl("xla", "xla")
    assert a == b and hash(a) == hash(b)  # models hold them as jit-static fields
    assert dataclasses.replace(a, interpret=True) != a


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_name_matches_the_reference_on_cpu(backend: str) -> None:
    shape = cases.SHAPES[2]
    args = cases.make_inputs(shape, cases.batch("mixed", shape.page_size), seed=3)
    options = dict(sm_scale=cases.sm_scale(shape), sliding_window=9, soft_cap=3.0)
    if backend == "pallas_mosaic_gpu":  # half precision only (f32 would run as tf32)
        with pytest.raises(ValueError, match="cannot run here"):
            ragged_paged_attention(*args, **options, backend=backend)
        return
    want = ragged_paged_attention_reference(*args, **options)
    got = ragged_paged_attention(*args, **options, backend=backend)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
