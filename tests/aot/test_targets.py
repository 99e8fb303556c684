"""The named targets (jaxserve/aot/targets.py) and the execution plan each one gets from its
facts alone, with no such device attached."""

from __future__ import annotations

import pytest

from jaxserve.aot.devices import planning_memory_bytes
from jaxserve.aot.targets import GIB, TARGETS, chip_facts, get_target
from jaxserve.config import EngineConfig
from jaxserve.models import ModelArchConfig
from jaxserve.pallas_kernels.ragged_paged_attention.target import AMPERE, HOPPER
from jaxserve.runner.machine import Machine
from jaxserve.runner.plan import make_plan
from jaxserve.runner.sharding import make_mesh

NAMES = ["h100", "h200", "a100-80g", "l4", "v5e-1", "v5e-4", "v5e-8", "v6e-1", "v6e-4", "v6e-8"]


def test_every_named_target_is_in_the_table() -> None:
    assert list(TARGETS) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_a_target_has_its_facts(name: str) -> None:
    t = get_target(name)
    assert t.name == name and t.source
    assert t.memory_bytes >= 16 * GIB and t.memory_bandwidth >= 300e9
    assert t.peak_flops >= 100e12
    if t.platform == "tpu":
        chips = int(name.split("-")[1])
        assert t.num_chips == chips
        x, y, z = t.chips_per_host_bounds
        assert x * y * z == chips and t.topology_name == f"{name[:3]}:{x}x{y}"
        assert t.compute_capability is None
    else:
        assert t.platform == "gpu" and t.num_chips == 1
        assert t.compute_capability and t.num_sms and t.shared_memory_per_block


def test_published_figures() -> None:
    """A few figures as the vendors publish them (dense bf16, memory, bandwidth)."""
    assert get_target("h200").memory_bytes == 141 * 10**9
    assert get_target("h100").peak_flops == get_target("h200").peak_flops == 989e12
    assert get_target("v5e-4").peak_flops == 197e12
    assert get_target("v6e-8").memory_bytes == 32 * GIB
    assert get_target("v6e-1").memory_bandwidth == 1640e9
    assert get_target("a100-80g").compute_capability == "8.0"


def test_an_unknown_target_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"--target must be one of h100, .*v6e-8; got 'v7x-1'"):
        get_target("v7x-1")


def _arch() -> ModelArchConfig:
    return ModelArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=128,
        max_position_embeddings=512,
    )


def _plan(name: str, **kwargs):
    target = get_target(name)
    machine = Machine(
        mesh=make_mesh(1),  # a mesh of this process's CPU: tp 1 never reads it
        chip=chip_facts(target),
        memory_bytes=target.memory_bytes,
        attached=False,
    )
    config = EngineConfig.from_kwargs(model="tiny-random-llama", **kwargs)
    return make_plan(config, machine, _arch(), "float32")


# Hopper's default is Mosaic GPU, but the installed CUDA's ptxas 12.8.0-12.9.0 miscompiles its
# masks (kernels.masked_wgmma_refusal: the target's compile would use that ptxas too).
_CUDA = chip_facts(get_target("h200"))["cuda_runtime_version"]
HOPPER_KERNEL = (
    "pallas_triton" if _CUDA is not None and 12080 <= _CUDA < 12091 else "pallas_mosaic_gpu"
)


@pytest.mark.parametrize(
    ("name", "attention", "generation"),
    [
        ("v6e-1", "pallas_tpu", None),
        ("v5e-4", "pallas_tpu", None),
        ("h200", HOPPER_KERNEL, HOPPER),
        ("a100-80g", "pallas_triton", AMPERE),
        ("l4", "pallas_triton", AMPERE),
    ],
)
def test_the_plan_of_a_target_comes_from_its_facts(name, attention, generation) -> None:
    plan = _plan(name)
    target = get_target(name)
    assert plan.platform == target.platform and plan.device_kind == target.device_kind
    assert plan.attention.name == attention and not plan.attention.interpret
    assert plan.gpu_generation == generation
    # float32 checkpoints run in bfloat16 on accelerators; RoPE and buckets are the device's
    assert plan.dtype == "bfloat16" and plan.sampler_draw == "xla"
    assert not plan.host_rope and not plan.mid_token_buckets and not plan.single_token_bucket
    assert plan.max_executables is None and not plan.attention_checked


def test_fp8_kv_on_hopper_takes_triton() -> None:
    plan = _plan("h100", kv_cache_dtype="fp8")
    assert plan.attention.name == "pallas_triton" and plan.kv_cache_dtype == "float8_e4m3fn"
    assert not plan.attention.soft_fp8


@pytest.mark.parametrize(
    ("name", "kv", "soft"),
    [("a100-80g", "fp8", True), ("a100-80g", "fp8_e4m3", True), ("a100-80g", "fp8_e5m2", False),
     ("l4", "fp8", False), ("h200", "fp8", False)],
)  # fmt: skip
def test_e4m3_pages_are_converted_in_software_below_sm89(name, kv, soft) -> None:
    """The plan follows the target's compute capability (A100: 8.0, L4: 8.9), not the
    attached device: Triton has no e4m3 conversion below sm_89."""
    plan = _plan(name, kv_cache_dtype=kv)
    assert plan.attention.name == "pallas_triton" and plan.attention.soft_fp8 is soft
    assert plan.as_dict()["attention_soft_fp8"] is soft
    assert ("integer ops" in plan.summary()) is soft


def test_a_gpu_plans_with_the_allocators_share_a_tpu_with_its_hbm(monkeypatch) -> None:
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert planning_memory_bytes(get_target("h100")) == int(80 * GIB * 0.75)
    assert planning_memory_bytes(get_target("v6e-1")) == 32 * GIB
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert planning_memory_bytes(get_target("a100-80g")) == int(80 * GIB * 0.9)
