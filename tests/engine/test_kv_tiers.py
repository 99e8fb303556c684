"""The host KV tier and swap preemption end to end (tiny-random-llama, greedy): with a device
pool small enough that shared prefixes are evicted (and come back from the host), and one that
forces preemption (swapped out and back in), the outputs EQUAL those of the same engine
settings without a host tier, and the stats counters move as they should."""

from __future__ import annotations

import random

import pytest
from engine_utils import assert_nothing_held, random_prompts

from jaxserve import LLM, SamplingParams
from jaxserve.cli import build_parser
from jaxserve.cli.flags import engine_kwargs

# 15 usable blocks of 8 tokens: 4 prefixes of 4 blocks do not fit together.
SETTINGS = dict(
    block_size=8,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    max_model_len=128,
    num_kv_blocks=16,
    warmup=False,
)
BLOCK_BYTES = 4 * 2 * 2 * 8 * 32 * 4  # tiny-random-llama: L=4, K=2, P=8, H=32, float32
NUM_HOST_BLOCKS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    """(no host tier, recompute) and (a host tier, swap), otherwise the same settings."""
    base = LLM("tiny-random-llama", **SETTINGS)
    tiered = LLM(
        "tiny-random-llama",
        **SETTINGS,
        kv_offloading_size=NUM_HOST_BLOCKS * BLOCK_BYTES / 2**30,
        preemption_mode="swap",
    )
    return base, tiered


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    before = llm.get_stats()
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    after = llm.get_stats()
    assert_nothing_held(llm.engine)
    return outs, {k: after[k] - before[k] for k in after if isinstance(after[k], int)}


@pytest.mark.slow
def test_prefixes_evicted_to_the_host_come_back_identical(engines) -> None:
    base, tiered = engines
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 1000) for _ in range(32)] for _ in range(4)]
    prompts = [prefixes[i % 4] + [rng.randrange(3, 1000) for _ in range(3)] for i in range(12)]
    expected, base_stats = _run(base, prompts, GREEDY)
    got, stats = _run(tiered, prompts, GREEDY)
    assert got == expected
    assert tiered.get_stats()["num_host_kv_blocks"] == NUM_HOST_BLOCKS
    assert stats["host_cache_hits"] > 0 and stats["host_cache_hits"] % 8 == 0
    assert stats["prefix_cache_hits"] >= stats["host_cache_hits"]
    assert stats["prefix_cache_hits"] > base_stats["prefix_cache_hits"]
    for key in ("device_to_host_bytes", "host_to_device_bytes"):
        assert stats[key] > 0 and stats[key] % BLOCK_BYTES == 0, key
    assert stats["host_to_device_bytes"] >= stats["host_cache_hits"] // 8 * BLOCK_BYTES
    assert base_stats["host_cache_hits"] == base_stats["device_to_host_bytes"] == 0


@pytest.mark.slow
def test_swap_preemption_gives_the_outputs_of_recompute(engines) -> None:
    base, tiered = engines
    prompts = random_prompts(4, seed=3, lo=16, hi=30)  # 4 x ~40 tokens: 15 blocks are short
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected, base_stats = _run(base, prompts, params)
    got, stats = _run(tiered, prompts, params)
    assert got == expected
    assert base_stats["num_preemptions"] > 0 and base_stats["num_swap_preemptions"] == 0
    assert stats["num_swap_preemptions"] > 0
    assert stats["num_preemptions"] == stats["num_swap_preemptions"] + stats["num_swap_fallbacks"]
    assert stats["device_to_host_bytes"] > 0 and stats["host_to_device_bytes"] > 0


@pytest.mark.slow
def test_a_failed_copy_step_is_recovered(engines, monkeypatch) -> None:
    """A step that raises in the host tier's copies aborts the batch and resets the host tier
    (its queued copies never ran); the next generate gives the same tokens again."""
    base, tiered = engines
    prompts = random_prompts(6, seed=5, lo=30, hi=40)
    expected, _ = _run(base, prompts, GREEDY)
    offload = tiered.engine.runner.kv_offload

    def fail(*args):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(offload, "apply", fail)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        tiered.generate(prompts, GREEDY, use_tqdm=False)
    assert_nothing_held(tiered.engine)
    assert not tiered.engine.scheduler.host.pool.hash_to_slot  # reset: nothing trusted
    monkeypatch.undo()
    assert _run(tiered, prompts, GREEDY)[0] == expected


def test_cli_flags_and_a_host_tier_too_small_for_one_block() -> None:
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--kv-offloading-size", "0.5", "--preemption-mode", "auto"]
    )
    kwargs = engine_kwargs(args)
    assert (kwargs["kv_offloading_size"], kwargs["preemption_mode"]) == (0.5, "auto")
    with pytest.raises(ValueError, match="kv_offloading_size=1e-09 GiB .* holds no KV block"):
        LLM("tiny-random-llama", **SETTINGS, kv_offloading_size=1e-9)
