"""Parallel sampling (n > 1): children fork the parent's prompt KV, with copy-on-write."""

from __future__ import annotations

from sched_fake_model import (
    check_all_free,
    make_request,
    make_scheduler,
    reference_output,
    run_to_completion,
)
from sched_fake_model import step as _step


def _family(prompt: list[int], n: int, max_tokens: int = 6):
    parent = make_request("p", prompt, max_tokens)
    children = [make_request(f"c{i}", prompt, max_tokens, arrival_time=i + 1) for i in range(n)]
    return parent, children


def test_children_share_prompt_blocks_and_copy_the_partial_one() -> None:
    sched, runner = make_scheduler(budget=64)
    parent, children = _family(list(range(6)), 2)  # blocks: [0..3] full, [4, 5] partial
    sched.add_request(parent)
    for child in children:
        sched.add_request(child, parent_req_id="p")
    so, _ = _step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["p"]  # children wait for the parent's prompt
    so, _ = _step(sched, runner)
    assert list(so.num_scheduled_tokens.items()) == [("c0", 1), ("c1", 1), ("p", 1)]
    assert [r.num_computed_tokens for r in so.scheduled_new_reqs] == [5, 5]
    kv = sched.kv_cache_manager
    ptable = kv.get_blocks("p")
    c0, c1 = kv.get_blocks("c0"), kv.get_blocks("c1")
    assert c0[0] is ptable[0] and c1[0] is ptable[0] and ptable[0].ref_cnt == 3
    assert len({ptable[1].block_id, c0[1].block_id, c1[1].block_id}) == 3
    assert all(b.ref_cnt == 1 for b in (ptable[1], c0[1], c1[1]))
    assert so.block_copies == [
        (ptable[1].block_id, c0[1].block_id),
        (ptable[1].block_id, c1[1].block_id),
    ]
    assert so.scheduled_new_reqs[0].block_ids == [ptable[0].block_id, c0[1].block_id]
    run_to_completion(sched, runner)
    expected = reference_output(parent.prompt_token_ids, parent.sampling_params)[0]
    for req in [parent, *children]:
        assert req.output_token_ids == expected  # greedy fake model: identical samples
    assert sched.get_stats()["num_cow_copies"] == 2
    check_all_free(sched)


def test_block_aligned_prompt_copies_the_full_last_block() -> None:
    # The child recomputes position 7, inside the (full, shared) second block: it must copy.
    sched, runner = make_scheduler(budget=64)
    parent, (child,) = _family(list(range(8)), 1)
    sched.add_request(parent)
    sched.add_request(child, parent_req_id="p")
    _step(sched, runner)
    so, _ = _step(sched, runner)
    ptable, ctable = sched.kv_cache_manager.get_blocks("p"), sched.kv_cache_manager.get_blocks("c0")
    assert ctable[0] is ptable[0] and ptable[0].ref_cnt == 2
    assert ctable[1] is not ptable[1] and so.block_copies == [
        (ptable[1].block_id, ctable[1].block_id)
    ]
    run_to_completion(sched, runner)
    assert child.output_token_ids == parent.output_token_ids
    check_all_free(sched)


def test_children_wait_through_a_chunked_parent_prefill() -> None:
    sched, runner = make_scheduler(budget=5)
    parent, (child,) = _family(list(range(13)), 1, max_tokens=3)
    sched.add_request(parent)
    sched.add_request(child, parent_req_id="p")
    scheduled = []
    while sched.has_unfinished_requests():
        so, _ = _step(sched, runner)
        scheduled.append(dict(so.num_scheduled_tokens))
    assert scheduled[:3] == [{"p": 5}, {"p": 5}, {"p": 3}]
    assert scheduled[3] == {"c0": 1, "p": 1}
    assert child.num_cached_tokens == 12 and child.output_token_ids == parent.output_token_ids
    check_all_free(sched)


def test_child_of_an_aborted_parent_computes_alone() -> None:
    sched, runner = make_scheduler(budget=4)
    parent, (child,) = _family(list(range(10)), 1)
    sched.add_request(parent)
    sched.add_request(child, parent_req_id="p")
    _step(sched, runner)  # parent mid-prefill
    sched.abort_requests("p")
    results = run_to_completion(sched, runner)
    expected = reference_output(child.prompt_token_ids, child.sampling_params)[0]
    assert results["c0"].new_token_ids == expected and sched.get_stats()["num_cow_copies"] == 0
    check_all_free(sched)
