"""Scheduler with the deterministic fake model: chunking, preemption, prefix hits, aborts,
policies, stops, bad input."""

from __future__ import annotations

import pytest
from sched_fake_model import (
    FakeRunner,
    check_all_free,
    check_invariants,
    make_request,
    make_scheduler,
    reference_output,
    run_to_completion,
)
from sched_fake_model import step as _step

from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.outputs import ModelRunnerOutput, TokenLogprobs
from jaxserve.request import RequestStatus


def test_single_request_matches_reference_and_frees_everything() -> None:
    sched, runner = make_scheduler()
    req = make_request("a", [3, 1, 4, 1, 5, 9], max_tokens=10)
    sched.add_request(req)
    so = sched.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.token_ids == [3, 1, 4, 1, 5, 9] and new.num_computed_tokens == 0
    assert new.block_ids == [1, 2] and so.num_scheduled_tokens == {"a": 6}
    sched.update_from_output(so, runner.execute(so))
    results = run_to_completion(sched, runner)
    expected, reason = reference_output([3, 1, 4, 1, 5, 9], req.sampling_params)
    assert req.output_token_ids == expected and len(expected) == 10 and reason == "length"
    assert results["a"].finish_reason == "length" and results["a"].new_token_ids == expected[1:]
    check_all_free(sched)
    assert sched.schedule().finished_req_ids == {"a"}


def test_chunked_prefill_spreads_a_long_prompt() -> None:
    sched, runner = make_scheduler(budget=16)
    prompt = list(range(50))
    sched.add_request(make_request("long", prompt, max_tokens=4))
    chunks = []
    sampled_at = []
    for i in range(8):
        so, outs = _step(sched, runner)
        chunks.append(so.total_num_scheduled_tokens)
        if outs:
            sampled_at.append(i)
    assert chunks[:4] == [16, 16, 16, 2] and chunks[4:7] == [1, 1, 1]
    assert sampled_at == [3, 4, 5, 6]  # nothing sampled mid-prefill
    assert not sched.has_unfinished_requests()
    check_all_free(sched)


def test_running_first_then_new_requests_in_batch_order() -> None:
    sched, runner = make_scheduler(budget=12)
    sched.add_request(make_request("a", list(range(20)), max_tokens=3))
    sched.add_request(make_request("b", list(range(30, 35)), max_tokens=3))
    so, _ = _step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 12}  # budget gone: b waits
    so, _ = _step(sched, runner)
    # a's rest (8) first, b admitted with the 4 left; new requests lead the batch order.
    assert list(so.num_scheduled_tokens.items()) == [("b", 4), ("a", 8)]
    assert [r.req_id for r in so.scheduled_cached_reqs] == ["a"]
    assert so.scheduled_cached_reqs[0].num_computed_tokens == 12
    run_to_completion(sched, runner)
    check_all_free(sched)


def test_preemption_in_a_tiny_pool_gives_the_same_tokens() -> None:
    # 6 usable blocks of 4 tokens; each request grows to 7 + 14 = 21 tokens (6 blocks).
    sched, runner = make_scheduler(num_blocks=7, budget=64)
    prompts = {f"r{i}": [i + 1] * 3 + list(range(i, i + 4)) for i in range(3)}
    reqs = {rid: make_request(rid, p, max_tokens=14) for rid, p in prompts.items()}
    for req in reqs.values():
        sched.add_request(req)
    preempted, resumed = set(), {}
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so, _ = _step(sched, runner)
        preempted |= so.preempted_req_ids
        for new in so.scheduled_new_reqs:
            if reqs[new.req_id].num_preemptions:
                resumed[new.req_id] = new
    assert preempted and sched.get_stats()["num_preemptions"] >= 1
    # The latest arrival is the first victim; a resumed request recomputes prompt + outputs.
    assert "r2" in preempted
    for new in resumed.values():
        assert new.num_prompt_tokens == 7 and len(new.token_ids) > 7
    for rid, req in reqs.items():
        assert req.output_token_ids == reference_output(prompts[rid], req.sampling_params)[0]
    check_all_free(sched)


def test_a_request_preempts_itself_when_it_is_the_lowest() -> None:
    sched, runner = make_scheduler(num_blocks=4, budget=64)  # 3 usable blocks
    a = make_request("a", list(range(4)), max_tokens=8, arrival_time=0.0)
    b = make_request("b", list(range(10, 14)), max_tokens=8, arrival_time=1.0)
    sched.add_request(a)
    sched.add_request(b)
    _step(sched, runner)  # both prefills (1 block each); both sample
    so, _ = _step(sched, runner)  # each needs a 2nd block: 3 usable, so b (last) must go
    assert so.preempted_req_ids == {"b"} and list(so.num_scheduled_tokens) == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting)[0] is b
    run_to_completion(sched, runner)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, b.sampling_params)[0]
    check_all_free(sched)


def test_prefix_hits_skip_computation_and_are_counted() -> None:
    sched, runner = make_scheduler(budget=64)
    shared = list(range(100, 116))  # 4 full blocks
    sched.add_request(make_request("a", shared + [1, 2], max_tokens=2))
    run_to_completion(sched, runner)
    computed_alone = runner.num_computed_tokens_total
    b = make_request("b", shared + [7, 7, 7], max_tokens=2)
    sched.add_request(b)
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert so.num_scheduled_tokens == {"b": 3}
    sched.update_from_output(so, runner.execute(so))
    run_to_completion(sched, runner)
    assert b.num_cached_tokens == 16
    assert runner.num_computed_tokens_total - computed_alone == 3 + 1  # 3 prompt, 1 decode
    assert b.output_token_ids == reference_output(b.prompt_token_ids, b.sampling_params)[0]
    # Exactly the cached prompt again: the last block is recomputed to get logits.
    c = make_request("c", shared, max_tokens=1)
    sched.add_request(c)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"c": 4} and c.num_cached_tokens == 12
    sched.update_from_output(so, runner.execute(so))
    stats = sched.get_stats()
    assert stats["prefix_cache_queries"] == 18 + 19 + 16
    assert stats["prefix_cache_hits"] == 16 + 12
    check_all_free(sched)


def test_prefix_caching_off_computes_everything() -> None:
    sched, runner = make_scheduler(caching=False)
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, list(range(12)), max_tokens=2))
        run_to_completion(sched, runner)
    stats = sched.get_stats()
    assert stats["prefix_cache_queries"] == 0 and stats["prefix_cache_hits"] == 0
    assert runner.num_computed_tokens_total == 2 * (12 + 1)


# 12: the owner's prompt takes 2 steps, and b is looked up in the second, beside a's last block
@pytest.mark.parametrize("budget", [64, 12])
def test_requests_sharing_an_uncached_prefix_wait_for_its_computation(budget: int) -> None:
    """An offline batch: a, b and c share 4 uncached blocks and arrive together. a computes
    them; b and c wait (keeping their places) until the blocks are cached, then hit all 4;
    d, unrelated, is not held up."""
    sched, runner = make_scheduler(budget=budget)
    shared = list(range(100, 116))  # 4 full blocks
    tails = {"a": [1], "b": [2], "c": [3, 3]}
    reqs = {rid: make_request(rid, shared + tail, max_tokens=2) for rid, tail in tails.items()}
    reqs["d"] = make_request("d", list(range(200, 206)), max_tokens=2)
    for req in reqs.values():
        sched.add_request(req)
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["a", "d"][: 1 + (budget > 17)]
    admitted = []
    while sched.has_unfinished_requests():
        admitted += [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        sched.update_from_output(so, runner.execute(so))
        check_invariants(sched)
        so = sched.schedule()
    assert [a for a in admitted if a[0] in "bc"] == [("b", 16), ("c", 16)]
    for req in reqs.values():
        want, _ = reference_output(req.prompt_token_ids, req.sampling_params)
        assert req.output_token_ids == want
    assert sched.get_stats()["prefix_cache_hits"] == 32
    check_all_free(sched)


def _abort_and_drain(sched: Scheduler, runner: FakeRunner, rid: str) -> None:
    outs = sched.abort_requests([rid, "no-such-id"])
    assert [(o.req_id, o.finish_reason, o.new_token_ids) for o in outs] == [(rid, "abort", [])]
    assert sched.abort_requests(rid) == []  # already gone
    check_invariants(sched)
    so = sched.schedule()
    assert rid in so.finished_req_ids and rid not in so.num_scheduled_tokens
    sched.update_from_output(so, runner.execute(so))
    run_to_completion(sched, runner)
    check_all_free(sched)


def test_abort_waiting() -> None:
    sched, runner = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3]))
    _abort_and_drain(sched, runner, "a")


def test_abort_running_decode_and_mid_prefill() -> None:
    sched, runner = make_scheduler(budget=8)
    sched.add_request(make_request("dec", [1, 2, 3], max_tokens=50))
    sched.add_request(make_request("pre", list(range(40)), max_tokens=5))
    _step(sched, runner)
    _step(sched, runner)
    pre = sched.requests["pre"]
    assert pre.status == RequestStatus.RUNNING and 0 < pre.num_computed_tokens < 40
    assert sched.requests["dec"].num_output_tokens >= 2
    sched.abort_requests("pre")
    _abort_and_drain(sched, runner, "dec")


def test_abort_between_schedule_and_update() -> None:
    sched, runner = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3]))
    so = sched.schedule()
    mro = runner.execute(so)
    sched.abort_requests("a")
    assert sched.update_from_output(so, mro) == []
    check_all_free(sched)


def test_abort_preempted() -> None:
    sched, runner = make_scheduler(num_blocks=4, budget=64)
    sched.add_request(make_request("a", list(range(4)), max_tokens=8))
    sched.add_request(make_request("b", list(range(10, 14)), max_tokens=8))
    _step(sched, runner)
    so, _ = _step(sched, runner)
    assert so.preempted_req_ids == {"b"}
    _abort_and_drain(sched, runner, "b")


def test_finish_requests_for_stop_strings() -> None:
    sched, runner = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=20))
    _step(sched, runner)
    (out,) = sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert out.finish_reason == "stop"
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests("a", RequestStatus.RUNNING)
    check_all_free(sched)


def _completion_order(sched: Scheduler, runner: FakeRunner) -> list[str]:
    order = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        order += [o.req_id for o in sched.update_from_output(so, runner.execute(so)) if o.finished]
    return order


def test_priority_policy_serves_lower_values_first() -> None:
    sched, runner = make_scheduler(max_seqs=1, policy="priority")
    for rid, prio, t in [("low", 5, 0.0), ("high", -1, 1.0), ("mid", 2, 2.0), ("mid2", 2, 3.0)]:
        sched.add_request(make_request(rid, [1, 2], max_tokens=2, priority=prio, arrival_time=t))
    assert _completion_order(sched, runner) == ["high", "mid", "mid2", "low"]
    check_all_free(sched)


def test_fcfs_policy_serves_in_arrival_order() -> None:
    sched, runner = make_scheduler(max_seqs=1)
    for i, rid in enumerate(["x", "y", "z"]):
        sched.add_request(make_request(rid, [1, 2], max_tokens=2, priority=-i, arrival_time=i))
    assert _completion_order(sched, runner) == ["x", "y", "z"]


def test_priority_preemption_evicts_the_lowest_priority() -> None:
    sched, runner = make_scheduler(num_blocks=4, budget=64, policy="priority")
    sched.add_request(make_request("low", list(range(4)), max_tokens=8, priority=9))
    sched.add_request(make_request("high", list(range(10, 14)), max_tokens=8, priority=0))
    _step(sched, runner)
    so, _ = _step(sched, runner)
    assert so.preempted_req_ids == {"low"}
    run_to_completion(sched, runner)
    check_all_free(sched)


def test_max_num_seqs_limits_the_batch() -> None:
    sched, runner = make_scheduler(max_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", [i, i + 1], max_tokens=3))
    while sched.has_unfinished_requests():
        so, _ = _step(sched, runner)
        assert len(so.num_scheduled_tokens) <= 2 and len(sched.running) <= 2
    check_all_free(sched)


def test_stops_eos_stop_token_min_tokens() -> None:
    prompt = [4, 4, 2]
    free_run, _ = reference_output(prompt, make_request("x", prompt, 12).sampling_params)
    eos = free_run[3]
    cases = {
        "eos": make_request("eos", prompt, 12, eos=frozenset({eos})),
        "stop_id": make_request("stop_id", prompt, 12, stop_token_ids=[free_run[2]]),
        "ignore": make_request("ignore", prompt, 12, eos=frozenset({eos}), ignore_eos=True),
        "min": make_request("min", prompt, 12, eos=frozenset({eos}), min_tokens=12),
    }
    sched, runner = make_scheduler()
    for req in cases.values():
        sched.add_request(req)
    results = run_to_completion(sched, runner)
    for rid, req in cases.items():
        expected, reason = reference_output(prompt, req.sampling_params, req.eos_token_ids)
        assert req.output_token_ids == expected, rid
        assert results[rid].finish_reason == reason, rid
    assert results["eos"].finish_reason == "stop" and results["eos"].stop_reason is None
    assert results["stop_id"].stop_reason == free_run[2]
    assert len(cases["stop_id"].output_token_ids) <= 3
    assert results["ignore"].finish_reason == "length"
    assert len(cases["min"].output_token_ids) == 12
    check_all_free(sched)


def test_max_model_len_and_pool_cap_generation_with_length() -> None:
    sched, runner = make_scheduler(max_model_len=10)
    a = make_request("a", list(range(7)), max_tokens=100)
    full = make_request("full", list(range(10)), max_tokens=100)  # prompt == max_model_len
    sched.add_request(a)
    sched.add_request(full)
    results = run_to_completion(sched, runner)
    assert a.num_tokens == 10 and results["a"].finish_reason == "length"
    assert full.num_output_tokens == 1 and results["full"].finish_reason == "length"
    sched, runner = make_scheduler(num_blocks=4)  # 3 blocks x 4 = 12 slots
    b = make_request("b", list(range(5)), max_tokens=100)
    sched.add_request(b)
    results = run_to_completion(sched, runner)
    assert b.num_tokens == 13 and results["b"].finish_reason == "length"
    check_all_free(sched)


@pytest.mark.parametrize(
    ("prompt", "extra", "match"),
    [
        ([], {}, "empty"),
        (list(range(300)), {}, "300 tokens, more than max_model_len=256"),
        (list(range(40)), {"num_blocks": 8}, "40 tokens needs 10 KV blocks of 4 tokens.*only 7"),
    ],
)
def test_bad_requests_raise_and_leave_nothing_held(prompt, extra, match) -> None:
    sched, runner = make_scheduler(**extra)
    with pytest.raises(ValueError, match=match):
        sched.add_request(make_request("bad", prompt))
    assert not sched.has_unfinished_requests() and "bad" not in sched.requests
    check_all_free(sched)
    sched.add_request(make_request("bad", [1, 2]))  # the id is free again
    sched.add_request(make_request("ok", [1, 2, 3]))
    results = run_to_completion(sched, runner)
    assert set(results) == {"bad", "ok"}
    check_all_free(sched)


def test_duplicate_id_and_bad_parent_raise() -> None:
    sched, runner = make_scheduler()
    sched.add_request(make_request("a", [1, 2]))
    with pytest.raises(ValueError, match="'a' is already in use"):
        sched.add_request(make_request("a", [3]))
    with pytest.raises(ValueError, match="parent 'zz'"):
        sched.add_request(make_request("c", [1, 2]), parent_req_id="zz")
    with pytest.raises(ValueError, match="differs from that of its parent"):
        sched.add_request(make_request("d", [1, 3]), parent_req_id="a")
    with pytest.raises(TypeError):
        sched.add_request("a")  # type: ignore[arg-type]
    assert sched.get_num_unfinished_requests() == 1
    run_to_completion(sched, runner)
    check_all_free(sched)


def test_logprobs_and_prompt_logprobs_pass_through() -> None:
    sched, runner = make_scheduler(budget=4)
    sched.add_request(
        make_request("a", list(range(6)), max_tokens=2, logprobs=1, prompt_logprobs=0)
    )
    so, outs = _step(sched, runner)
    (out,) = outs  # mid-prefill: prompt logprobs only
    assert out.new_token_ids == [] and len(out.new_prompt_logprobs) == 4
    so, outs = _step(sched, runner)
    (out,) = outs
    assert len(out.new_token_ids) == 1 and len(out.new_logprobs) == 1
    assert out.new_logprobs[0].token_ids == out.new_token_ids
    assert len(out.new_prompt_logprobs) == 1  # position 4 predicts prompt token 5


def test_sample_for_mid_prefill_request_is_discarded() -> None:
    sched, _ = make_scheduler(budget=4)
    req = make_request("a", list(range(10)))
    sched.add_request(req)
    so = sched.schedule()
    outs = sched.update_from_output(so, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]]))
    assert outs == [] and req.output_token_ids == [] and req.num_computed_tokens == 4


def test_multi_token_samples_stop_at_the_first_stop() -> None:
    sched, _ = make_scheduler()
    req = make_request("a", [1, 2, 3], max_tokens=10, stop_token_ids=[9], logprobs=0)
    sched.add_request(req)
    so = sched.schedule()
    lps = [TokenLogprobs([t], [-1.0], [1]) for t in (5, 9, 6)]
    mro = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5, 9, 6]], logprobs={"a": lps})
    (out,) = sched.update_from_output(so, mro)
    assert out.new_token_ids == [5, 9] and out.new_logprobs == lps[:2]
    assert out.finish_reason == "stop" and out.stop_reason == 9
    assert req.output_token_ids == [5, 9] and req.all_token_ids == [1, 2, 3, 5, 9]
    check_all_free(sched)


def test_stats_keys_and_peak_utilization() -> None:
    sched, runner = make_scheduler()
    assert sched.schedule().is_empty and sched.get_stats()["num_steps"] == 0
    sched.add_request(make_request("a", list(range(5)), max_tokens=3))
    run_to_completion(sched, runner)
    stats = sched.get_stats()
    assert set(stats) >= {
        "num_kv_blocks",
        "num_usable_kv_blocks",
        "num_free_kv_blocks",
        "kv_cache_usage",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "num_steps",
        "peak_kv_slot_utilization",
    }
    # The pool as configured (the null block included), what requests can hold, what is free.
    assert stats["num_kv_blocks"] == 64 and stats["num_usable_kv_blocks"] == 63
    assert stats["num_free_kv_blocks"] == 63
    assert stats["kv_cache_usage"] == 0.0 and stats["num_steps"] == 3
    # Steps: 5 live of 8 slots, 6 of 8, 7 of 8.
    assert stats["peak_kv_slot_utilization"] == pytest.approx(7 / 8)
