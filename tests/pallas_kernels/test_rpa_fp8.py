"""FP8 KV pages (kv_quant.py): the saturating round trip, write_kv's quantization, every
implementation that reads FP8 pages against the reference on the same FP8 pages (tight) and
against full precision (bounded), and the implementations that cannot read them refused."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rpa_cases as cases
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.pallas_kernels.ragged_paged_attention import (
    Target,
    ragged_paged_attention_chunked,
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
    ragged_paged_attention_tpu,
    select_attention,
    write_kv,
)
from jaxserve.pallas_kernels.ragged_paged_attention.kernels import mosaic_gpu_kernel
from jaxserve.pallas_kernels.ragged_paged_attention.kv_quant import (
    dequantize,
    e4m3fn_from_bits,
    quantize,
)
from jaxserve.pallas_kernels.ragged_paged_attention.target import AMPERE, HOPPER

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
# Relative rounding error of a normal value: half a unit in the last place (3 / 2 mantissa
# bits); below the smallest normal (2^-6 / 2^-14) the step is absolute (2^-9 / 2^-16).
REL_ERROR = {E4M3: 2.0**-4, E5M2: 2.0**-3}
ABS_STEP = {E4M3: 2.0**-9, E5M2: 2.0**-16}
K_SCALE, V_SCALE = np.float32(0.5), np.float32(3.0)  # numpy: importing compiles nothing
KERNELS = {
    "xla": ragged_paged_attention_chunked,
    "gpu": functools.partial(ragged_paged_attention_gpu, interpret=True),
    # e4m3 pages read as bytes and converted with integer ops (GPUs below sm_89)
    "gpu_soft": functools.partial(ragged_paged_attention_gpu, interpret=True, soft_fp8=True),
    "tpu": functools.partial(ragged_paged_attention_tpu, interpret=True),
}


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([E4M3, E5M2]),
    scale=st.floats(0.05, 20.0),
    values=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=32),
)
def test_round_trip_is_within_half_a_step_and_saturates(dtype, scale, values) -> None:
    x = jnp.asarray(values, jnp.float32)
    stored = quantize(x, jnp.float32(scale), dtype)
    assert stored.dtype == dtype
    back = np.asarray(dequantize(stored, jnp.float32(scale)))
    assert np.isfinite(back).all(), "the cast must saturate, never give inf or NaN"
    limit = float(jnp.finfo(dtype).max) * scale
    clipped = np.clip(np.asarray(x), -limit, limit)
    bound = np.abs(clipped) * REL_ERROR[dtype] + ABS_STEP[dtype] * scale
    assert (np.abs(back - clipped) <= bound * (1 + 1e-6)).all()


def test_e4m3_bytes_convert_exactly_with_integer_ops() -> None:
    """Every one of the 256 float8_e4m3fn bit patterns (normals, subnormals, +-0, +-NaN)
    converts to the f32 bits of jnp's own cast, and to the same bf16 / f16 values."""
    bits = np.arange(256, dtype=np.uint8)
    want = jnp.asarray(bits).view(E4M3).astype(jnp.float32)
    got = jax.jit(e4m3fn_from_bits)(jnp.asarray(bits))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
    assert np.isnan(np.asarray(got)).sum() == 2 and np.signbit(np.asarray(got)[0x80])
    for dtype in (jnp.bfloat16, jnp.float16):
        np.testing.assert_array_equal(
            np.asarray(got.astype(dtype)).view(np.uint16),
            np.asarray(jnp.asarray(bits).view(E4M3).astype(dtype)).view(np.uint16),
        )


def test_write_kv_stores_quantized_tokens_at_their_slots() -> None:
    pages = jnp.zeros((2, 4, 4, 16), E4M3)  # [K, S, P, H]
    rng = np.random.default_rng(0)
    new_k = jnp.asarray(rng.standard_normal((3, 2, 16)) * 100, jnp.float32)  # [T, K, H]
    new_v = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float32)
    slots = jnp.asarray([5, 9, 0], jnp.int32)  # the last one: padding, into the null block
    k_pages, v_pages = write_kv(pages, pages, new_k, new_v, slots, K_SCALE, V_SCALE)
    assert k_pages.dtype == v_pages.dtype == E4M3
    flat_k = k_pages.reshape(2, 16, 16)
    np.testing.assert_array_equal(
        np.asarray(flat_k[:, 9].astype(jnp.float32)),
        np.asarray(quantize(new_k[1], K_SCALE, E4M3).astype(jnp.float32)),
    )
    # 100 x N(0, 1) / 0.5 overflows e4m3 (max 448): saturated, never NaN.
    assert np.abs(np.asarray(flat_k.astype(jnp.float32))).max() == 448.0
    untouched = np.delete(np.arange(16), [0, 5, 9])
    assert not np.asarray(flat_k[:, untouched].astype(jnp.float32)).any()


def _fp8_inputs(shape, dtype, kv_dtype):
    """The grid's mixed batch in `dtype` and the same K / V quantized to `kv_dtype` pages."""
    args = cases.make_inputs(shape, cases.batch("mixed", shape.page_size), dtype)
    q, k_pages, v_pages, *metadata = args
    k8, v8 = quantize(k_pages, K_SCALE, kv_dtype), quantize(v_pages, V_SCALE, kv_dtype)
    return args, (q, k8, v8, *metadata)


@pytest.mark.parametrize(
    ("kernel", "shape", "dtype", "kv_dtype"),
    [
        ("xla", cases.SHAPES[1], jnp.float32, E4M3),
        ("xla", cases.SHAPES[3], jnp.bfloat16, E5M2),
        ("gpu", cases.SHAPES[1], jnp.float32, E4M3),
        ("gpu_soft", cases.SHAPES[1], jnp.bfloat16, E4M3),
        pytest.param("gpu", cases.SHAPES[3], jnp.bfloat16, E4M3, marks=pytest.mark.slow),
        ("tpu", cases.SHAPES[1], jnp.bfloat16, E4M3),
        pytest.param("tpu", cases.SHAPES[3], jnp.float32, E5M2, marks=pytest.mark.slow),
    ],
    ids=["xla-f32-e4m3", "xla-bf16-e5m2", "gpu-f32-e4m3", "gpu_soft-bf16-e4m3", "gpu-bf16-e4m3",
         "tpu-bf16-e4m3", "tpu-f32-e5m2"],
)  # fmt: skip
def test_kernel_reads_fp8_pages_like_the_reference(kernel, shape, dtype, kv_dtype) -> None:
    full, fp8 = _fp8_inputs(shape, dtype, kv_dtype)
    options = dict(sm_scale=cases.sm_scale(shape), sliding_window=7)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    want = ragged_paged_attention_reference(*fp8, **options, **scales)
    got = jax.jit(functools.partial(KERNELS[kernel], **options))(*fp8, **scales)
    assert got.dtype == dtype
    tol = cases.TOLERANCE[dtype]  # the same quantized data: only summation order differs
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
    )
    assert not np.asarray(got[int(fp8[5][-1]) :], np.float32).any(), "padding rows are zero"
    # Against the unquantized pages: each K / V value is off by at most REL_ERROR relatively,
    # and the output is a convex mix of V rows, so its error is a few REL_ERROR of |V| (~1).
    exact = ragged_paged_attention_reference(*full, **options)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - exact.astype(jnp.float32))))
    assert err < 4 * REL_ERROR[jnp.dtype(kv_dtype)], f"fp8 vs full precision: {err:.3g}"


def test_scales_are_traced_not_compiled_in() -> None:
    """One compilation serves every scale value, and the value matters."""
    shape = cases.SHAPES[0]
    _, fp8 = _fp8_inputs(shape, jnp.float32, E4M3)
    traces = []

    def attend(*args, k_scale, v_scale):
        traces.append(1)  # runs once per trace
        return ragged_paged_attention_chunked(
            *args, sm_scale=0.125, k_scale=k_scale, v_scale=v_scale
        )

    fn = jax.jit(attend)
    a = fn(*fp8, k_scale=K_SCALE, v_scale=V_SCALE)
    b = fn(*fp8, k_scale=K_SCALE, v_scale=jnp.float32(6.0))
    assert len(traces) == 1
    np.testing.assert_allclose(np.asarray(b), 2 * np.asarray(a), rtol=1e-6, atol=1e-6)


def _target(platform: str, kv: str, **kw) -> Target:
    return Target(
        platform=platform,
        dtype="float32" if platform == "cpu" else "bfloat16",
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        kv_cache_dtype=kv,
        **kw,
    )


@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e5m2"])
def test_registry_refuses_what_cannot_read_fp8_pages(kv: str) -> None:
    impl, refused = select_attention("auto", _target("cpu", kv))
    assert impl.name == "xla"
    assert refused == [f"cpu cannot read an FP8 KV cache ({kv} pages)"]
    with pytest.raises(ValueError, match="cpu cannot read an FP8 KV cache"):
        select_attention("cpu", _target("cpu", kv))
    impl, refused = select_attention("auto", _target("gpu", kv, gpu_generation=HOPPER))
    assert impl.name == "pallas_triton"
    if mosaic_gpu_kernel() is not None:
        assert refused == [f"pallas_mosaic_gpu cannot read an FP8 KV cache ({kv} pages)"]
        with pytest.raises(ValueError, match="pallas_mosaic_gpu cannot read an FP8 KV cache"):
            select_attention("pallas_mosaic_gpu", _target("gpu", kv, gpu_generation=HOPPER))
    assert select_attention("auto", _target("tpu", kv))[0].name == "pallas_tpu"


@pytest.mark.parametrize(
    ("capability", "kv", "soft"),
    [("8.0", "float8_e4m3fn", True), ("8.6", "float8_e4m3fn", True),
     ("8.9", "float8_e4m3fn", False), ("9.0", "float8_e4m3fn", False),
     ("8.0", "float8_e5m2", False), (None, "float8_e4m3fn", False)],
)  # fmt: skip
def test_triton_converts_e4m3_in_software_below_sm89(capability, kv, soft) -> None:
    """Triton cannot emit the e4m3 cast below compute capability 8.9 (XLA's Triton pipeline
    aborts the process): the Triton kernel is told to convert the bytes itself there."""
    generation = HOPPER if capability == "9.0" else AMPERE
    target = _target("gpu", kv, gpu_generation=generation, compute_capability=capability)
    impl, _ = select_attention("auto", target)
    assert impl.name == "pallas_triton" and impl.soft_fp8 is soft
    plain = _target("gpu", None, gpu_generation=AMPERE, compute_capability="8.0")
    assert not select_attention("auto", plain)[0].soft_fp8, "only FP8 pages are converted"


def test_kernels_that_cannot_read_fp8_pages_raise() -> None:
    shape = cases.SHAPES[1]
    _, fp8 = _fp8_inputs(shape, jnp.bfloat16, E4M3)
    cpu = functools.partial(ragged_paged_attention_chunked, sm_scale=0.1, row_kernel="cpu")
    with pytest.raises(ValueError, match='row_kernel="cpu" needs float32 q and pages'):
        jax.eval_shape(cpu, *fp8)
    if mosaic_gpu_kernel() is not None:
        mosaic = functools.partial(mosaic_gpu_kernel(), sm_scale=0.1, interpret=True)
        with pytest.raises(ValueError, match="Mosaic GPU kernel cannot read an FP8 KV cache"):
            jax.eval_shape(mosaic, *fp8)


@pytest.mark.parametrize(
    ("scales", "message"),
    [
        (dict(k_scale=K_SCALE), "k_scale and v_scale must be given together"),
        (
            dict(k_scale=K_SCALE, v_scale=np.ones(2, np.float32)),
            r"v_scale must be a float32 scalar",
        ),
        (
            dict(k_scale=np.float16(1), v_scale=V_SCALE),
            r"k_scale must be a float32 scalar \(shape \(\)\), got float16",
        ),
    ],
)
def test_bad_scales_are_refused(scales, message) -> None:
    _, fp8 = _fp8_inputs(cases.SHAPES[0], jnp.float32, E4M3)
    fn = functools.partial(ragged_paged_attention_chunked, sm_scale=0.1, **scales)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(fn, *fp8)
