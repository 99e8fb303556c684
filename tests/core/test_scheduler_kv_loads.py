"""Property test of the KV connector's loads in the scheduler (no jax): random workloads whose
prompts share prefixes a producer stored, with loads synchronous or asynchronous, delayed by
random numbers of steps, cut short at random (a producer killed mid-transfer), aborts among
them (some while their KV loads), and both kv_load_failure_policy values. After every step the
block accounting holds (sched_fake_model.check_invariants: a request waiting for its KV holds
its blocks and nothing else); at the end every block is free and no request is lost: each one
produced exactly what the fake model gives it alone (the fake cache is read back through the
block tables, so a block loaded with the wrong contents changes the output), or, under "fail",
ended with "error" before producing anything, and only when its promised KV did not load."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_fake_model import (
    FakeBlockStore,
    FakeRunner,
    check_all_free,
    check_invariants,
    make_request,
    merge_output,
    reference_output,
    run_to_completion,
)
from sched_harness import Harness

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_connector.shared_storage import SharedStorageConnector
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.kv_transfer_config import KVTransferConfig
from jaxserve.request import RequestStatus

# Prefixes the producer stored (the last one only in part: its tail block is missing).
_STORED = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]]
_UNSTORED = [5] * 9


def _scheduler(num_blocks, block_size, budget, max_seqs, policy, load_async, caching=True):
    config = KVTransferConfig(kv_role="kv_consumer", kv_load_failure_policy=policy,
                              load_async=load_async)  # fmt: skip
    store = FakeBlockStore()
    for prefix in _STORED:
        store.put_prompt(prefix, block_size)
    connector = SharedStorageConnector(config, store, block_size)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
        kv_connector=connector,
    )
    runner = FakeRunner(num_blocks, block_size, sched.kv_cache_manager.block_pool)
    runner.store = store
    return sched, runner


_request = st.tuples(
    st.sampled_from(range(3)),  # which prefix: _STORED[0], _STORED[1], _UNSTORED
    st.lists(st.integers(0, 15), max_size=6),  # prompt tail
    st.integers(1, 6),  # max_tokens
    st.booleans(),  # promised its prefix's KV (kv_transfer_params)
)
_op = st.one_of(
    st.tuples(st.just("add"), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([2, 3, 4]),
    num_blocks=st.integers(6, 20),
    budget=st.integers(1, 16),
    max_seqs=st.integers(1, 4),
    policy=st.sampled_from(["recompute", "fail"]),
    load_async=st.booleans(),
    run_ahead=st.booleans(),
    specs=st.lists(_request, min_size=1, max_size=6),
    ops=st.lists(_op, max_size=25),
    rng=st.randoms(use_true_random=False),
)
def test_random_loads_keep_invariants_and_lose_no_request(
    block_size, num_blocks, budget, max_seqs, policy, load_async, run_ahead, specs, ops, rng
) -> None:
    sched, runner = _scheduler(num_blocks, block_size, budget, max_seqs, policy, load_async)
    runner.load_delay = lambda job: rng.randint(1, 4)
    runner.load_cut = lambda job: len(job.block_ids) if rng.random() < 0.7 else rng.randrange(3)
    h = Harness(sched, runner, run_ahead=run_ahead)
    prefixes = [*_STORED, _UNSTORED]
    pending = list(specs)
    for i, op in enumerate(ops + [("add", 0)] * len(specs)):
        if op[0] == "add" and pending:
            which, tail, max_tokens, promise = pending.pop(0)
            prompt = prefixes[which] + tail
            params = None
            if promise:  # the prefill server's answer: its stored full blocks
                num = len(prefixes[which]) // block_size * block_size
                params = {"do_remote_prefill": True, "remote_num_tokens": num}
            req = make_request(f"r{i}", prompt, max_tokens, arrival_time=float(i),
                               kv_transfer_params=params)  # fmt: skip
            h.add(req)
        elif op[0] == "abort" and h.reqs:
            rid = list(h.reqs)[op[1] % len(h.reqs)]
            if sched.abort_requests(rid):
                h.aborted.add(rid)
            check_invariants(sched)
        elif op[0] == "step":
            for _ in range(op[1]):
                h.step()
    for _ in range(3000):
        if not sched.has_unfinished_requests():
            break
        h.step()
    h.drain()
    so = sched.schedule()  # an idle step hands the last aborts to the runner
    assert sched.update_from_output(so, runner.execute(so)) == []
    check_all_free(sched)
    assert not runner.jobs  # every load written or dropped
    cap = min(64, (num_blocks - 1) * block_size + 1)  # what the pool holds for one request
    for rid, req in h.reqs.items():
        expected, reason = reference_output(
            req.prompt_token_ids, req.sampling_params, max_num_tokens=cap
        )
        got, result = req.output_token_ids, h.results.get(rid)
        if rid in h.aborted:
            assert got == expected[: len(got)], rid
        elif result.finish_reason == "error":
            assert policy == "fail" and got == [] and req.num_preemptions == 0, rid
            assert req.sampling_params.kv_transfer_params is not None, rid
            assert req.status == RequestStatus.FINISHED_ERROR and "kv_load_failure_policy" in (
                req.stop_reason
            )
        else:
            assert got == expected and result.finish_reason == reason, rid
            assert result.new_token_ids == expected, rid


def test_a_request_waits_for_its_kv_while_others_run_and_abort_frees_it():
    sched, runner = _scheduler(32, 4, 32, 4, "recompute", load_async=True)
    runner.load_delay = lambda job: 10**9  # until released below
    loading = make_request("loads", _STORED[0] + [3, 3], 4)
    other = make_request("other", [7, 7, 7, 7, 7], 4)
    doomed = make_request("doomed", _STORED[1] + [1], 4)
    for req in (loading, other, doomed):
        sched.add_request(req)
    results = {}
    for _ in range(3):
        so = sched.schedule()
        for out in sched.update_from_output(so, runner.execute(so)):
            merge_output(results, out)
        check_invariants(sched)
    assert loading.status == doomed.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert other.num_output_tokens > 0  # the engine steps on meanwhile
    assert sched.get_stats()["num_requests_waiting_for_remote_kvs"] == 2
    sched.abort_requests("doomed")
    check_invariants(sched)
    for entry in runner.jobs.values():  # the loads' data arrives
        entry[1] = 1
    results.update(run_to_completion(sched, runner))
    assert "doomed" not in runner.jobs
    want, _ = reference_output(loading.prompt_token_ids, loading.sampling_params)
    assert loading.output_token_ids == want
    assert results["loads"].num_cached_tokens == 8  # its two blocks came from the store
    assert sched.get_stats()["kv_connector_loaded_blocks"] == 2
    check_all_free(sched)


def test_two_requests_sharing_a_prefix_load_it_once():
    """The second request's next block is being loaded for the first: it waits in the queue
    and then hits the loaded blocks in the prefix cache, instead of loading them again."""
    sched, runner = _scheduler(32, 4, 32, 4, "recompute", load_async=True)
    runner.load_delay = lambda job: 3
    first = make_request("first", _STORED[0] + [1, 2], 3)
    second = make_request("second", _STORED[0] + [9], 3)
    sched.add_request(first)
    sched.add_request(second)
    results = run_to_completion(sched, runner)
    assert sched.get_stats()["kv_connector_loaded_blocks"] == 2  # _STORED[0]'s blocks, once
    assert results["second"].num_cached_tokens == 8  # device hits on the loaded blocks
    for req in (first, second):
        want, _ = reference_output(req.prompt_token_ids, req.sampling_params)
        assert req.output_token_ids == want
    check_all_free(sched)
