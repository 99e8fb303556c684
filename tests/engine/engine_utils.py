"""Shared helpers of the engine tests: a small engine configuration, random prompts, and the
docs/architecture.md check that nothing is held."""

from __future__ import annotations

import random

from jaxserve import LLMEngine

SMALL = dict(
    block_size=8, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, warmup=False
)


def random_prompts(n: int, seed: int, lo: int = 4, hi: int = 50) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def assert_nothing_held(engine: LLMEngine) -> None:
    stats = engine.get_stats()
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.has_unfinished_requests()
    assert stats["num_free_kv_blocks"] == stats["num_usable_kv_blocks"]
    assert all(b.ref_cnt == 0 for b in engine.scheduler.kv_cache_manager.block_pool.blocks[1:])


def step_program(runner, half: str) -> str:
    """The runner's attribute that runs the step's ``half`` ("_forward" or "_sample"): the
    fused program's ("_fused") where the plan fuses the step (runner/fused_step.py, the CPU),
    else the half's own. Fault injection and watchers patch it."""
    return "_fused" if getattr(runner, "fused_compiles", None) is not None else half
