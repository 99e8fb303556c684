"""The roofline and the report's totals on hand-made compilation results (no compiler)."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_config import TINY_LLAMA

from jaxserve.aot.compiler import BucketResult
from jaxserve.aot.report import CompileReport
from jaxserve.aot.roofline import StepModel, estimate
from jaxserve.aot.table import format_report
from jaxserve.aot.targets import get_target
from jaxserve.models.hf_configs import arch_config_from_hf
from jaxserve.runner.memory_plan import plan_memory

TARGET = get_target("v6e-1")
MODEL = StepModel(weights_bytes=10**9, kv_bytes_per_token=10**5, attention_flops_per_context=1e6)


def _step(tokens: int, rows: int, flops: float, alias: int, temp: int = 0) -> BucketResult:
    memory = dict(
        argument_size_in_bytes=alias + 10**9,
        output_size_in_bytes=alias + 10**3,
        alias_size_in_bytes=alias,
        temp_size_in_bytes=temp,
        generated_code_size_in_bytes=0,
    )
    return BucketResult("step", True, tokens=tokens, rows=rows, width=8, sampling_lists=(0, 0),
                        compile_s=1.0, memory=memory, flops=flops)  # fmt: skip


def test_a_decode_step_is_memory_bound_and_counts_the_kv_it_reads() -> None:
    est = estimate(_step(64, 64, 1e12, 0), MODEL, TARGET, "decode", context=1000)
    read = 10**9 + 64 * 10**5 + 64 * 1000 * 10**5  # weights, new K/V, the context's K/V
    assert est.bytes == read and est.flops == 1e12 + 64 * 1000 * 1e6
    assert est.bound == "memory" and est.seconds == pytest.approx(read / TARGET.memory_bandwidth)
    assert est.tokens_per_s == pytest.approx(64 / est.seconds)


def test_a_prefill_chunk_is_compute_bound() -> None:
    est = estimate(_step(2048, 256, 4e13, 0), MODEL, TARGET, "prefill")
    assert est.context == 1024 and est.bound == "compute"
    assert est.seconds == pytest.approx((4e13 + 2048 * 1024 * 1e6) / TARGET.peak_flops)


def test_a_failed_bucket_has_no_estimate() -> None:
    failed = BucketResult("step", False, error="boom", tokens=4, rows=4, width=8)
    assert estimate(failed, MODEL, TARGET, "decode", context=8) is None
    with pytest.raises(ValueError, match="phase must be"):
        estimate(_step(4, 4, 1.0, 0), MODEL, TARGET, "train")


def _report(buckets: list[BucketResult]) -> CompileReport:
    arch = arch_config_from_hf(TINY_LLAMA)
    memory = plan_memory(arch, dtype="bfloat16", kv_cache_dtype="bfloat16",
                         tensor_parallel_size=1, block_size=16, max_model_len=256,
                         max_num_seqs=8, max_num_batched_tokens=8,
                         device_memory_bytes=TARGET.memory_bytes, memory_utilization=0.9,
                         num_kv_blocks=65)  # fmt: skip
    return CompileReport("tiny", TARGET, {"attention": "pallas_tpu", "dtype": "bfloat16",
                         "kv_cache_dtype": "bfloat16", "tensor_parallel_size": 1}, memory,
                         buckets, MODEL, decode_context=16)  # fmt: skip


def test_totals_need_every_compilation_aliased_and_fitting() -> None:
    pool = 65 * 16 * 2 * 2 * 4 * 128 * 2  # blocks x P x (K, V) x L x K heads x H x bf16
    good = _report([_step(4, 4, 1e9, pool), _step(8, 8, 2e9, pool, temp=10**6)])
    totals = good.totals()
    assert totals["ok"] and totals["fits"] and totals["kv_aliased"]
    assert totals["compiled_peak_bytes"] == pool + 10**9 + 10**3 + 10**6
    assert totals["compiled_over_planned"] == totals["compiled_peak_bytes"] / good.planned_bytes
    assert good.decode_estimate().tokens == 8
    text = format_report(good.as_dict())
    assert "verdict: OK" in text and "step T=8 R=8 B=8" in text
    not_aliased = _report([_step(4, 4, 1e9, pool - 1)])
    assert not not_aliased.kv_aliased and not not_aliased.ok
    failed = _report([_step(4, 4, 1e9, pool), BucketResult("copy", False, error="x", copies=1)])
    assert failed.totals()["num_failed"] == 1 and not failed.ok
    assert "FAILED" in format_report(failed.as_dict())


def test_a_step_estimate_adds_its_sample_half_and_a_sample_has_its_label() -> None:
    """The forward half ("step") is estimated with the FLOPs of the sample half of its R
    without lists (the whole step's); a sample is listed by its rows and lists."""
    pool = 65 * 16 * 2 * 2 * 4 * 128 * 2
    fields = ("argument", "output", "alias", "temp", "generated_code")
    memory = {f"{f}_size_in_bytes": 10**3 for f in fields}
    sample = BucketResult("sample", True, rows=8, sampling_lists=(0, 0), donated_bytes=0,
                          compile_s=0.1, memory=memory, flops=5e6)  # fmt: skip
    lists = BucketResult("sample", True, rows=8, sampling_lists=(65, 65), donated_bytes=0,
                         compile_s=0.1, memory=memory, flops=9e9)  # fmt: skip
    report = _report([_step(8, 8, 2e9, pool), sample, lists])
    assert report.decode_estimate().flops == 2e9 + 5e6 + 8 * 16 * 1e6
    assert report.totals()["kv_aliased"]
    text = format_report(report.as_dict())
    assert "sample R=8 " in text and "sample R=8 lists=(65, 65)" in text


def test_the_sample_half_and_a_copy_run_beside_the_resident_weights_and_pages() -> None:
    """A compilation's live bytes on the device are its own (arguments + outputs - aliased +
    temporaries) plus the resident arrays (weights, KV pool, KV scales) it does not take as
    arguments: the sample half takes none, so its temporaries come on top of all of them, and
    a copy takes the pages only; a result that does not say (None) takes them all."""
    pool = 65 * 16 * 2 * 2 * 4 * 128 * 2
    step = dataclasses.replace(_step(8, 8, 2e9, pool), resident_arg_bytes=pool + 10**9)
    sample_memory = dict(argument_size_in_bytes=10**4, output_size_in_bytes=10,
                         alias_size_in_bytes=0, temp_size_in_bytes=5 * 10**9,
                         generated_code_size_in_bytes=0)  # fmt: skip
    sample = BucketResult("sample", True, rows=8, sampling_lists=(0, 0), donated_bytes=0,
                          resident_arg_bytes=0, compile_s=0.1, memory=sample_memory)  # fmt: skip
    copy_memory = dict(sample_memory, argument_size_in_bytes=pool, output_size_in_bytes=pool,
                       alias_size_in_bytes=pool, temp_size_in_bytes=0)  # fmt: skip
    copy = BucketResult("copy", True, copies=2, donated_bytes=pool, resident_arg_bytes=pool,
                        compile_s=0.1, memory=copy_memory)  # fmt: skip
    report = _report([step, sample, copy])
    resident = report.memory.weights_bytes + pool
    assert report.resident_bytes == resident
    assert report.live_bytes(step) == step.peak_bytes  # it holds them all as arguments
    assert report.live_bytes(sample) == resident + 10**4 + 10 + 5 * 10**9
    assert report.live_bytes(copy) == pool + report.memory.weights_bytes
    assert report.totals()["compiled_peak_bytes"] == report.live_bytes(sample)
    assert report.as_dict()["buckets"][1]["live_bytes"] == report.live_bytes(sample)
    unknown = dataclasses.replace(sample, resident_arg_bytes=None)
    assert report.live_bytes(unknown) == unknown.peak_bytes
