"""HostBlockPool (core/host_block_pool.py) directly: LRU order, pins, the per-step locks that
keep a slot from being rewritten while a copy of the step reads it, and the configuration
checks of the host tier and the preemption modes."""

from __future__ import annotations

import pytest
from sched_fake_model import check_all_free, make_request, make_scheduler, run_to_completion

from jaxserve.config import CacheConfig, EngineConfig
from jaxserve.core.host_block_pool import HostBlockPool
from jaxserve.core.sched.preemption import PreemptionPolicy


def _h(i: int) -> bytes:
    return bytes([i]) * 32


def test_offload_is_lru_and_skips_slots_this_step_uses() -> None:
    host = HostBlockPool(2)
    host.offload(_h(1), 5)
    host.offload(_h(1), 6)  # already here: no copy
    host.offload(_h(2), 7)
    assert host.take_copies() == ([(5, 0), (7, 1)], [])
    host.offload(_h(1), 5)  # a device eviction of a hash the host has: it becomes the MRU
    host.offload(_h(3), 8)  # takes the LRU slot, hash 2's
    assert host.lookup(_h(2)) is None and host.lookup(_h(3)) == 1
    host.restore(host.lookup(_h(1)), 9)
    host.offload(_h(4), 10)  # both slots are in use this step: dropped
    assert host.num_dropped == 1
    assert host.take_copies() == ([(8, 1)], [(0, 9)])
    assert host.num_takeable() == 2


def test_pins_keep_slots_and_private_slots_free_after_the_step() -> None:
    host = HostBlockPool(3)
    private = host.write_pinned(4, None)
    shared = host.write_pinned(5, _h(1))
    host.take_copies()
    host.pin(shared)  # a second swapped request holds it
    assert host.num_takeable() == 1
    host.restore(private, 6)
    host.unpin(private)  # read this step: free only after the step's copies
    assert private not in host.free and host.num_takeable() == 1
    host.take_copies()
    assert private in host.free
    host.unpin(shared)
    host.unpin(shared)
    assert list(host.lru) == [shared] and host.num_takeable() == 3
    with pytest.raises(ValueError, match="not pinned"):
        host.unpin(shared)


def test_swap_preemption_keeps_computed_tokens_and_outputs() -> None:
    # 6 usable blocks of 4 tokens for three requests that grow to 13 tokens: preemption.
    sched, runner = make_scheduler(
        num_blocks=7, budget=64, num_host_blocks=16, preemption_mode="swap"
    )
    reqs = [make_request(f"r{i}", [i + 1] * 5, max_tokens=8) for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    results = run_to_completion(sched, runner)
    stats = sched.get_stats()
    assert stats["num_swap_preemptions"] == stats["num_preemptions"] > 0
    assert stats["device_to_host_bytes"] > 0 and stats["host_to_device_bytes"] > 0
    check_all_free(sched)
    # Fewer tokens computed than with recompute: the swapped ones are not computed again.
    sched2, runner2 = make_scheduler(num_blocks=7, budget=64)
    for i in range(3):
        sched2.add_request(make_request(f"r{i}", [i + 1] * 5, max_tokens=8))
    recomputed = run_to_completion(sched2, runner2)
    assert sched2.get_stats()["num_preemptions"] > 0
    assert runner.num_computed_tokens_total < runner2.num_computed_tokens_total
    assert {rid: out.new_token_ids for rid, out in recomputed.items()} == {
        rid: out.new_token_ids for rid, out in results.items()
    }
    assert len(results) == 3


def test_auto_compares_copy_time_with_recompute_time() -> None:
    policy = PreemptionPolicy("auto", swap_bytes_per_s=1000.0, block_bytes=100)
    assert not policy.wants_swap(1, 10)  # no step observed yet: no prefill rate
    policy.observe_step(100, 1.0)  # 100 tokens/s
    assert policy.wants_swap(4, 50)  # 0.4 s of copies against 0.5 s of prefill
    assert not policy.wants_swap(6, 50)
    assert PreemptionPolicy("swap").wants_swap(100, 1)
    assert not PreemptionPolicy("recompute").wants_swap(1, 100)
    slow = PreemptionPolicy("auto", swap_bytes_per_s=1000.0, block_bytes=100, swap_latency_s=0.01)
    slow.observe_step(100, 1.0)
    assert policy.wants_swap(4, 41)  # 0.4 s against 0.41 s
    assert not slow.wants_swap(4, 41)  # 0.02 s of latency + 0.4 s against 0.41 s


@pytest.mark.parametrize("caching", [True, False])
def test_recompute_tokens_leave_out_the_prefix_cache_hits(caching: bool) -> None:
    sched, runner = make_scheduler(
        block_size=4, num_host_blocks=8, caching=caching, preemption_mode="auto"
    )
    req = make_request("r", list(range(1, 11)), max_tokens=4)
    sched.add_request(req)
    sched.update_from_output(so := sched.schedule(), runner.execute(so))
    assert req.num_computed_tokens == 10
    kv = sched.kv_cache_manager
    # Two full hashed blocks come back as prefix hits; only the partial one is recomputed.
    assert kv.recompute_tokens(req) == (2 if caching else 10)
    assert kv.swap_blocks(req) == 3 + 3  # none on the host yet: 3 down, 3 up


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(preemption_mode="swap"), ValueError, "preemption_mode='swap'.*kv_offloading_size"),
        (dict(preemption_mode="auto"), ValueError, "preemption_mode='auto'.*kv_offloading_size"),
        (dict(preemption_mode="lru"), ValueError, "preemption_mode must be one of"),
        (dict(kv_offloading_size=-1.0), ValueError, "kv_offloading_size must be .* >= 0, got -1"),
        (dict(kv_offloading_size=float("nan")), ValueError, "kv_offloading_size must be"),
        (dict(kv_offloading_size="2"), TypeError, "kv_offloading_size must be a number"),
        (dict(kv_offloading_size=True), TypeError, "kv_offloading_size must be a number"),
        (
            dict(kv_offloading_size=1.0, enable_prefix_caching=False),
            ValueError,
            "kv_offloading_size=1.0 GiB would never be used",
        ),
    ],
)
def test_bad_host_tier_settings_are_refused(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        CacheConfig(**kwargs)
    with pytest.raises(error, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_good_host_tier_settings() -> None:
    cache = EngineConfig.from_kwargs(kv_offloading_size=0.5, preemption_mode="auto").cache
    assert (cache.kv_offloading_size, cache.preemption_mode) == (0.5, "auto")
    assert CacheConfig().preemption_mode == "recompute" and CacheConfig().kv_offloading_size == 0
