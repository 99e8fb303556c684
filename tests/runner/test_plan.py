"""The execution plan: every platform decision made once, from the chip and the model; the
kernel self-check and what happens when a kernel disagrees with the reference."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from jaxserve.checkpoints_tools.tiny_random import tiny_random_llama_arch
from jaxserve.config import EngineConfig
from jaxserve.pallas_kernels.ragged_paged_attention import cpu_rows
from jaxserve.runner import plan as plan_module
from jaxserve.runner.plan import make_plan, resolve_dtype
from jaxserve.runner.sharding import make_mesh


@pytest.mark.parametrize(
    ("requested", "declared", "platform", "want"),
    [
        ("auto", "float32", "cpu", "float32"),
        ("auto", "float32", "gpu", "bfloat16"),  # as vLLM runs float32 checkpoints
        ("auto", "float32", "tpu", "bfloat16"),
        ("auto", None, "gpu", "bfloat16"),
        ("auto", "float16", "tpu", "float16"),
        ("auto", "bfloat16", "cpu", "bfloat16"),
        ("auto", "int8", "cpu", "float32"),  # a dtype we do not run: the default
        ("float32", "bfloat16", "gpu", "float32"),  # an explicit choice is kept
    ],
)
def test_dtype(requested, declared, platform, want):
    assert resolve_dtype(requested, declared, platform) == want


def _plan(**kwargs):
    config = EngineConfig.from_kwargs(model="tiny-random-llama", **kwargs)
    return make_plan(config, make_mesh(1), tiny_random_llama_arch(), "float32")


def test_cpu_plan():
    plan = _plan()
    assert plan.platform == "cpu" and plan.gpu_generation is None
    assert plan.attention.name == ("cpu" if cpu_rows.available() else "xla")
    assert plan.dtype == plan.kv_cache_dtype == "float32"
    assert plan.host_rope and plan.mid_token_buckets and plan.single_token_bucket
    d = plan.as_dict()
    for key in ("platform", "device_kind", "attention", "sampler_draw", "dtype", "kv_cache_dtype"):
        assert key in d
    assert d["tensor_parallel_size"] == 1
    assert (
        plan.grammar_fill_threads == d["grammar_fill_threads"] == plan_module.grammar_fill_threads()
    )


def test_grammar_fill_threads_are_half_the_cpus_from_two_to_eight_and_none_on_one(monkeypatch):
    for cpus, threads in ((1, 0), (2, 2), (3, 2), (4, 2), (6, 3), (16, 8), (64, 8)):
        monkeypatch.setattr(plan_module.os, "sched_getaffinity", lambda _, n=cpus: range(n))
        assert plan_module.grammar_fill_threads() == threads


def test_the_engine_fills_grammar_masks_with_the_plans_threads(monkeypatch):
    """The plan's count reaches the grammar library (the library's default is none: row by
    row, which tests/structured/test_batch_fill.py compares with the pool), and the output is
    valid."""
    threads = 2
    monkeypatch.setattr(plan_module, "grammar_fill_threads", lambda: threads)
    llm = LLM(max_model_len=64, max_num_batched_tokens=32, max_num_seqs=2)
    assert llm.engine.info.plan.grammar_fill_threads == threads
    regex = StructuredOutputsParams(regex="[ab]{4}")
    params = SamplingParams(max_tokens=6, structured_outputs=regex)
    out = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[ab]{4}", out.text)
    matcher = llm.engine.structured.check(params).new_state().matcher
    assert matcher.batch_filler is not None


def test_an_explicit_backend_that_cannot_run_lists_what_can():
    with pytest.raises(ValueError, match=r"'pallas_mosaic_gpu' cannot run here.*these can: \["):
        _plan(attention_backend="pallas_mosaic_gpu")


def test_a_kernel_that_disagrees_with_the_reference_is_replaced(monkeypatch, caplog):
    if not cpu_rows.available():
        pytest.skip("the C++ kernel does not build here")
    real = plan_module.self_check

    def check(attention, target):
        return "max abs error 0.5 > 0.002" if attention.kernel == "cpu" else real(attention, target)

    monkeypatch.setattr(plan_module, "self_check", check)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        plan = _plan()
    assert plan.attention.name == "xla"
    assert "attention cpu disagrees with the reference here (max abs error 0.5" in caplog.text
    assert "using xla instead" in caplog.text
    with pytest.raises(ValueError, match="disagrees with the reference.*strict_kernels=True"):
        _plan(strict_kernels=True)


def test_the_self_check_passes_the_real_kernels():
    plan = _plan()
    assert plan_module.self_check(plan.attention, _target(plan)) is None


def _target(plan):
    from jaxserve.pallas_kernels.ragged_paged_attention import Target

    arch = tiny_random_llama_arch()
    return Target(
        "cpu",
        plan.dtype,
        num_q_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        page_size=16,
    )


def test_the_plan_is_logged_once_and_reported(caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        llm = LLM("tiny-random-llama", num_kv_blocks=8, max_model_len=32, warmup=False)
    lines = [r.getMessage() for r in caplog.records if "execution plan" in r.getMessage()]
    assert len(lines) == 1 and "platform=cpu" in lines[0]
    assert llm.get_stats()["plan"]["attention"] in lines[0]


def test_a_soft_capped_model_never_gets_a_kernel_without_the_cap(monkeypatch):
    """The model's attention soft cap (Gemma 2) is part of the plan's target: a kernel that
    declares no soft cap is passed over, with the reason, not chosen and left to ignore it."""
    from jaxserve.pallas_kernels.ragged_paged_attention import KERNELS

    no_cap = dataclasses.replace(KERNELS["cpu"], soft_cap=False)
    monkeypatch.setitem(KERNELS, "cpu", no_cap)
    config = EngineConfig.from_kwargs(model="tiny-random-llama")
    capped = dataclasses.replace(tiny_random_llama_arch(), attn_logit_softcap=50.0)
    plan = make_plan(config, make_mesh(1), capped, "float32")
    assert plan.attention.name == "xla"
    assert "cpu has no soft cap" in plan.attention_refused
