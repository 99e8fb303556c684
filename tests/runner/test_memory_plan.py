"""runner/memory_plan.py: the weights, KV and workspace arithmetic on real models' configs
(config.json only, written here), the fit rule, the engine's check before loading, the
engine's pool agreeing with the plan, and gpu_memory_utilization as vLLM's name."""

from __future__ import annotations

import json
import pathlib

import pytest

from jaxserve import LLM
from jaxserve.checkpoints_tools.load import load_arch
from jaxserve.checkpoints_tools.tiny_random import tiny_random_llama_arch
from jaxserve.config import EngineConfig
from jaxserve.models import ModelArchConfig
from jaxserve.runner import factory
from jaxserve.runner.logprob_chunks import CHUNK_ROWS
from jaxserve.runner.memory_plan import (
    MemoryPlan,
    blocks_for_budget,
    memory_plan_for,
    plan_memory,
    resolve_max_model_len,
    workspace_bytes,
)
from jaxserve.runner.memory_sizes import forward_workspace_bytes, sample_workspace_bytes

GIB = 1 << 30

# meta-llama/Meta-Llama-3-8B's config.json (its fields as published).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
# Qwen/Qwen2.5-0.5B's shape: tied embeddings, qkv bias, 2 KV heads.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}


def write_config(folder: pathlib.Path, config: dict) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory: pytest.TempPathFactory) -> ModelArchConfig:
    return load_arch(write_config(tmp_path_factory.mktemp("llama3-8b"), LLAMA3_8B))


def plan(arch: ModelArchConfig, **overrides: object) -> MemoryPlan:
    settings: dict = dict(
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
        tensor_parallel_size=1,
        block_size=16,
        max_model_len=arch.max_position_embeddings,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        device_memory_bytes=141 * GIB,
        memory_utilization=0.9,
    )
    return plan_memory(arch, **(settings | overrides))


def test_llama3_8b_weights_and_kv_per_token(llama3_8b: ModelArchConfig) -> None:
    memory = plan(llama3_8b)
    assert memory.num_params == 8_030_261_248
    assert memory.weights_bytes == memory.weights_bytes_total == 16_060_522_496
    assert memory.kv_bytes_per_token == 131_072  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    f32 = plan(llama3_8b, dtype="float32", kv_cache_dtype="float32")
    assert f32.weights_bytes == 2 * 16_060_522_496 and f32.kv_bytes_per_token == 2 * 131_072


def test_llama3_8b_on_an_h200(llama3_8b: ModelArchConfig) -> None:
    memory = plan(llama3_8b)
    # The forward half: 2048 tokens x (4 D + 2 (N + K) H + 3 F) x 2 bytes + 256 rows x V x 4
    # bytes x 2; the sample half: 256 rows x V x 4 bytes x 17, the larger.
    forward = 2048 * (4 * 4096 + 2 * (32 + 8) * 128 + 3 * 14336) * 2 + 256 * 128256 * 4 * 2
    assert forward == 547_880_960
    workspace = 256 * 128256 * 4 * 17
    assert memory.workspace_bytes == workspace == 2_232_680_448
    assert memory.budget_bytes == int(141 * GIB * 0.9) == 136_257_837_465
    blocks = (136_257_837_465 - 16_060_522_496 - workspace) // (131_072 * 16)
    assert memory.num_kv_blocks_fit == blocks == 56_249
    assert memory.max_kv_tokens == (blocks - 1) * 16 == 899_968  # the null block is no one's
    assert memory.max_num_seqs_at_max_model_len == (blocks - 1) // 512 == 109
    assert memory.num_kv_blocks == blocks  # 256 x 512 + 1 would be more: not capped
    assert memory.fits and memory.shortfall() is None


def test_llama3_8b_tensor_parallel(llama3_8b: ModelArchConfig) -> None:
    norms = 65 * 4096  # 2 per layer + the final norm, replicated
    sharded = 8_030_261_248 - norms
    tp2 = plan(llama3_8b, tensor_parallel_size=2)
    assert tp2.weights_bytes == (sharded // 2 + norms) * 2 == 8_030_527_488
    assert tp2.weights_bytes_total == 16_060_522_496
    assert tp2.kv_bytes_per_token == 65_536 and tp2.kv_cache_sharded
    tp8 = plan(llama3_8b, tensor_parallel_size=8)
    assert tp8.weights_bytes == (sharded // 8 + norms) * 2 == 2_008_031_232
    assert tp8.kv_bytes_per_token == 16_384
    assert tp8.max_kv_tokens > tp2.max_kv_tokens > plan(llama3_8b).max_kv_tokens
    # 16 devices, 8 KV heads: k/v projections and KV pages stay whole on every device.
    kv_proj = 32 * 2 * 4096 * 1024
    tp16 = plan(llama3_8b, tensor_parallel_size=16)
    assert tp16.weights_bytes == ((sharded - kv_proj) // 16 + norms + kv_proj) * 2
    assert tp16.kv_bytes_per_token == 131_072 and not tp16.kv_cache_sharded


def test_tied_embeddings_and_qkv_bias_count_once(tmp_path: pathlib.Path) -> None:
    arch = load_arch(write_config(tmp_path, QWEN25_05B))
    memory = plan(arch, max_model_len=4096)
    assert memory.num_params == 494_032_768  # Qwen2.5-0.5B's published count
    assert memory.kv_bytes_per_token == 2 * 24 * 2 * 64 * 2
    # 14 heads on 4 devices: q/o replicated (tp does not divide N), and K = 2 < 4 too.
    tp4 = plan(arch, tensor_parallel_size=4, max_model_len=4096)
    assert not tp4.kv_cache_sharded and tp4.kv_bytes_per_token == memory.kv_bytes_per_token


def test_does_not_fit(llama3_8b: ModelArchConfig) -> None:
    small = plan(llama3_8b, device_memory_bytes=16 * GIB)  # 0.9 x 16 GiB < 16.06 GB of weights
    assert not small.fits and small.max_kv_tokens == 0 and small.num_kv_blocks == 0
    assert small.max_num_seqs_at_max_model_len == 0
    assert "16060522496 bytes of weights" in small.shortfall()
    with pytest.raises(ValueError, match=r"model 'llama' does not fit .* exceed the budget"):
        small.check("llama")
    # 19.5 GiB: the weights fit, with room for about 4200 tokens: not one sequence of 8192.
    tight = plan(llama3_8b, device_memory_bytes=int(19.5 * GIB))
    assert not tight.fits and 0 < tight.max_kv_tokens < 8192
    assert "one sequence of max_model_len=8192 needs 512 blocks" in tight.shortfall()
    assert plan(llama3_8b, device_memory_bytes=int(19.5 * GIB), max_model_len=2048).fits


def test_explicit_pool_is_checked_against_the_whole_device(llama3_8b: ModelArchConfig) -> None:
    # 0.9 x 19 GiB would not hold weights + workspace + 8192 tokens; the whole 19 GiB does.
    pool = 8192 // 16 + 1
    fits = plan(llama3_8b, device_memory_bytes=19 * GIB, num_kv_blocks=pool)
    assert fits.fits and fits.budget_bytes == 19 * GIB and fits.num_kv_blocks == pool
    assert fits.max_kv_tokens == 8192 and fits.max_num_seqs_at_max_model_len == 1
    too_big = plan(llama3_8b, device_memory_bytes=19 * GIB, num_kv_blocks=100_000)
    assert not too_big.fits
    with pytest.raises(ValueError, match="num_kv_blocks=100000"):
        too_big.check("llama")


def test_pool_is_capped_at_what_the_engine_can_use(llama3_8b: ModelArchConfig) -> None:
    memory = plan(llama3_8b, max_model_len=1024, max_num_seqs=4)
    assert memory.num_kv_blocks == 4 * 64 + 1 < memory.num_kv_blocks_fit
    assert memory.max_kv_tokens == (memory.num_kv_blocks_fit - 1) * 16


def test_a_producers_pool_leaves_room_for_its_held_offers(llama3_8b: ModelArchConfig) -> None:
    """A JaxTransferConnector producer's offers may hold max_held_offers_fraction of its pool's
    memory (gathered copies, replicated over the mesh): the plan sizes pool + cap together."""
    block = 131_072 * 16
    free = 136_257_837_465 - 16_060_522_496 - 2_232_680_448  # the H200 plan's KV budget
    assert (
        plan(llama3_8b).num_kv_blocks == free // block == 56_249 and not plan(llama3_8b).held_offers
    )
    producer = plan(llama3_8b, held_offers_fraction=0.5)
    n = producer.num_kv_blocks
    assert n == 37_499 and producer.held_offers.blocks(n) == 18_749  # n + n / 2 blocks fit
    assert producer.held_offers_bytes == 18_749 * block
    assert (n + 18_749) * block <= free < (n + 1 + 18_750) * block  # the most that fit
    assert producer.max_kv_tokens == (n - 1) * 16 and producer.fits
    # tp 8: pages sharded on the KV heads, each gathered block whole on every device (8 pool
    # blocks' bytes there): the cap, a fraction of the pool's bytes, is 1/16 of its blocks.
    tp8 = plan(llama3_8b, tensor_parallel_size=8, held_offers_fraction=0.5)
    reserve = tp8.held_offers
    assert reserve.copy_ratio == 8 and reserve.bytes_per_copy_block == block
    assert reserve.blocks(tp8.num_kv_blocks) == tp8.num_kv_blocks // 16
    assert tp8.held_offers_bytes <= 0.5 * tp8.num_kv_blocks * tp8.kv_bytes_per_block
    # An explicit pool is checked with its cap beside it: 513 blocks fit 19 GiB, twice not.
    fits = plan(llama3_8b, device_memory_bytes=19 * GIB, num_kv_blocks=513)
    assert fits.fits and plan(llama3_8b, device_memory_bytes=19 * GIB, num_kv_blocks=513,
                              held_offers_fraction=0.5).fits  # fmt: skip
    full = plan(llama3_8b, device_memory_bytes=19 * GIB, num_kv_blocks=513, held_offers_fraction=1)
    assert full.held_offers_bytes == 513 * block and not full.fits
    assert f"{513 * block} of held KV offers" in full.shortfall()
    with pytest.raises(ValueError, match="max_held_offers_fraction"):
        full.check("llama")
    with pytest.raises(ValueError, match=r"held_offers_fraction must be a number in \(0, 1\]"):
        plan(llama3_8b, held_offers_fraction=0)


def test_only_a_transfer_producer_reserves_held_offers() -> None:
    def reserve(kv_connector: str, kv_role: str):
        extra = {"max_held_offers_fraction": 0.25} if kv_connector == "JaxTransferConnector" else {}
        config = EngineConfig.from_kwargs(
            kv_transfer_config={"kv_connector": kv_connector, "kv_role": kv_role,
                                "kv_connector_extra_config": extra},
        )  # fmt: skip
        return memory_plan_for(config, tiny_random_llama_arch(), dtype="float32",
                               kv_cache_dtype="float32", max_model_len=256,
                               device_memory_bytes=1 << 30).held_offers  # fmt: skip

    assert reserve("JaxTransferConnector", "kv_producer").fraction == 0.25
    assert reserve("JaxTransferConnector", "kv_both").fraction == 0.25
    assert reserve("JaxTransferConnector", "kv_consumer") is None
    assert reserve("SharedStorageConnector", "kv_both") is None


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (dict(dtype="int8"), ValueError, "dtype must be one of"),
        (dict(kv_cache_dtype="fp8"), ValueError, "kv_cache_dtype must be one of"),
        (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size must be >= 1, got 0"),
        (dict(block_size=2.5), TypeError, "block_size must be an int, got 2.5"),
        (dict(device_memory_bytes=0), ValueError, "device_memory_bytes must be >= 1"),
        (dict(memory_utilization=1.5), ValueError, r"memory_utilization must be in \(0, 1\]"),
        (dict(num_kv_blocks=True), TypeError, "num_kv_blocks must be an int"),
    ],
)
def test_bad_arguments_are_named(
    llama3_8b: ModelArchConfig, overrides: dict, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        plan(llama3_8b, **overrides)


def test_max_model_len_within_the_model() -> None:
    arch = tiny_random_llama_arch()
    assert resolve_max_model_len(None, arch) == 2048 == resolve_max_model_len(2048, arch)
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds .*=2048"):
        resolve_max_model_len(4096, arch)


def test_forward_workspace_scales_with_the_step_budget() -> None:
    arch = tiny_random_llama_arch()
    one = forward_workspace_bytes(arch, "float32", max_num_batched_tokens=1, max_num_seqs=1)
    assert one == (4 * 128 + 2 * 6 * 32 + 3 * 256) * 4 + arch.vocab_size * 8
    activations = one - arch.vocab_size * 8
    # The logits reserve is max(max_num_seqs, rows of one prompt-logprob chunk) rows: the
    # step computes prompt logprobs of up to CHUNK_ROWS (256) rows at a time, after sampling
    # (logprob_chunks.py), so 64 tokens with 8 sequences reserve 64 rows of logits, not 8.
    many = forward_workspace_bytes(arch, "float32", max_num_batched_tokens=64, max_num_seqs=8)
    assert many == 64 * activations + 64 * arch.vocab_size * 8
    big = forward_workspace_bytes(arch, "float32", max_num_batched_tokens=2048, max_num_seqs=8)
    assert big == 2048 * activations + CHUNK_ROWS * arch.vocab_size * 8
    seqs = forward_workspace_bytes(arch, "float32", max_num_batched_tokens=2048, max_num_seqs=512)
    assert seqs == 2048 * activations + 512 * arch.vocab_size * 8


def test_the_workspace_is_the_larger_half_and_the_sample_half_is_per_row(llama3_8b) -> None:
    """The step's halves are two executables run in turn: the reserve is the larger one's
    buffers, never their sum. The sample half's are 17 f32 [R, V] buffers (its logits and the
    sampler's temporaries, measured by the real compilers: memory_sizes._SAMPLE_BUFFERS),
    linear in max_num_seqs and V, independent of the token budget, the dtype and tp."""
    arch = llama3_8b
    assert sample_workspace_bytes(arch, max_num_seqs=256) == 256 * 128256 * 4 * 17
    assert sample_workspace_bytes(arch, max_num_seqs=512) == 2 * sample_workspace_bytes(
        arch, max_num_seqs=256
    )
    for tokens, seqs in [(2048, 256), (8192, 16), (16384, 256), (64, 64)]:
        forward = forward_workspace_bytes(arch, "bfloat16", max_num_batched_tokens=tokens,
                                          max_num_seqs=seqs)  # fmt: skip
        sample = sample_workspace_bytes(arch, max_num_seqs=seqs)
        total = workspace_bytes(arch, "bfloat16", max_num_batched_tokens=tokens, max_num_seqs=seqs)
        assert total == max(forward, sample) < forward + sample
    # Llama-3-8B at the engine's defaults: the sampler's buffers (2.08 GiB) outweigh the
    # forward's activations and logits (0.51 GiB).
    default = workspace_bytes(arch, "bfloat16", max_num_batched_tokens=2048, max_num_seqs=256)
    assert default == sample_workspace_bytes(arch, max_num_seqs=256)
    # A long prefill chunk with few sequences: the forward's.
    long = workspace_bytes(arch, "bfloat16", max_num_batched_tokens=16384, max_num_seqs=16)
    assert long == forward_workspace_bytes(arch, "bfloat16", max_num_batched_tokens=16384,
                                           max_num_seqs=16)  # fmt: skip
    # Per device: tensor parallelism shrinks the weights and KV, not the reserve.
    plans = [plan(llama3_8b, tensor_parallel_size=tp) for tp in (1, 8)]
    assert plans[0].workspace_bytes == plans[1].workspace_bytes == default


def test_the_sample_half_reserves_what_the_platforms_compiler_keeps(llama3_8b) -> None:
    """XLA:TPU keeps up to 15.1 f32 [R, V] temporaries live in the sample half, XLA:GPU 6.1
    (memory_sizes._SAMPLE_BUFFERS): 17 and 8 buffers with the logits; a platform not measured
    (the CPU, or None) reserves the larger."""
    rows_by_vocab = 256 * 128256 * 4
    buffers = {"tpu": 17, "gpu": 8, "cpu": 17, None: 17}
    for platform, count in buffers.items():
        sample = sample_workspace_bytes(llama3_8b, max_num_seqs=256, platform=platform)
        assert sample == rows_by_vocab * count
        assert plan(llama3_8b, platform=platform).workspace_bytes == sample
    # On a GPU more KV fits: the reserve is 1.18 GiB smaller.
    gpu, tpu = plan(llama3_8b, platform="gpu"), plan(llama3_8b, platform="tpu")
    assert gpu.max_kv_tokens > tpu.max_kv_tokens
    with pytest.raises(ValueError, match="platform must be 'cpu', 'gpu', 'tpu' or None, got 'x'"):
        plan(llama3_8b, platform="x")


def test_blocks_for_budget_counts_what_is_used_and_caps() -> None:
    sizes = dict(budget_bytes=1000, bytes_per_block=100, max_useful_blocks=99)
    assert blocks_for_budget(used_bytes=300, **sizes) == 7
    assert blocks_for_budget(used_bytes=300 + 250, **sizes) == 4  # weights + workspace
    assert blocks_for_budget(used_bytes=1200, **sizes) == 0  # over budget: none, not negative
    assert blocks_for_budget(used_bytes=0, **sizes | dict(max_useful_blocks=3)) == 3
    assert blocks_for_budget(used_bytes=0, **sizes | dict(max_useful_blocks=None)) == 10


ENGINE = dict(
    max_model_len=256, max_num_seqs=64, max_num_batched_tokens=256, block_size=16, warmup=False
)


@pytest.mark.slow
def test_engine_pool_agrees_with_the_plan_on_cpu() -> None:
    config = EngineConfig.from_kwargs(
        model="tiny-random-llama", gpu_memory_utilization=0.005, **ENGINE
    )
    memory = memory_plan_for(
        config,
        tiny_random_llama_arch(),
        dtype="float32",
        kv_cache_dtype="float32",
        max_model_len=256,
        device_memory_bytes=config.cache.cpu_memory_bytes,
    )
    assert memory.fits and memory.num_kv_blocks == memory.num_kv_blocks_fit  # not capped
    llm = LLM("tiny-random-llama", gpu_memory_utilization=0.005, **ENGINE)
    # The engine's pool, null block included, is the plan's; the blocks it reports (without
    # the null block) hold max_kv_tokens.
    assert llm.engine.info.num_kv_blocks == memory.num_kv_blocks
    assert llm.get_stats()["num_usable_kv_blocks"] * 16 == memory.max_kv_tokens
    assert llm.engine.info.memory == memory
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 1


def test_engine_refuses_a_model_that_cannot_fit_before_loading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("load_checkpoint called for a model that does not fit")

    monkeypatch.setattr(factory, "load_checkpoint", no_loading)
    large = dict(max_num_batched_tokens=2048, max_num_seqs=256)
    # 24 MiB: 3.4 MB of weights + 15.7 MB of workspace (a 2048-token step budget, 256 rows: not
    # the demo's defaults) fit, not with 2048 tokens of KV (4 MiB).
    with pytest.raises(ValueError, match=r"'tiny-random-llama' does not fit .*max_model_len=2048"):
        LLM("tiny-random-llama", cpu_memory_bytes=24 << 20, **large)
    with pytest.raises(ValueError, match=r"bytes of weights .* exceed the budget"):
        LLM("tiny-random-llama", cpu_memory_bytes=16 << 20, **large)
    with pytest.raises(ValueError, match="num_kv_blocks=5000 x 32768 bytes"):
        LLM("tiny-random-llama", cpu_memory_bytes=64 << 20, num_kv_blocks=5000)


def test_gpu_memory_utilization_is_memory_utilization() -> None:
    config = EngineConfig.from_kwargs(gpu_memory_utilization=0.5)
    assert config.cache.memory_utilization == 0.5
    same = EngineConfig.from_kwargs(gpu_memory_utilization=0.5, memory_utilization=0.5)
    assert same == config
    with pytest.raises(
        ValueError, match=r"gpu_memory_utilization=0.5 and memory_utilization=0.7 .* give one"
    ):
        EngineConfig.from_kwargs(gpu_memory_utilization=0.5, memory_utilization=0.7)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 0"):
        EngineConfig.from_kwargs(gpu_memory_utilization=0)
    with pytest.raises(ValueError, match=r"memory_utilization must be in \(0, 1\], got True"):
        EngineConfig.from_kwargs(memory_utilization=True)
    with pytest.raises(TypeError, match="unknown engine argument 'gpu_mem_util'.*'gpu_memory_u"):
        EngineConfig.from_kwargs(gpu_mem_util=0.5)
