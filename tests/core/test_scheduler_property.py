"""Property test: random add / fork / abort / step sequences with random budgets, pools, block
sizes, host KV tiers, preemption modes and speculative drafts (right or wrong at random). After
every step the block accounting of both tiers holds (docs/architecture.md); at the end
everything is free, and every request produced exactly what the fake model gives it alone (the
fake model reads its KV back through the block tables, so a block restored from the host with
the wrong contents changes the output)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_fake_model import (
    FakeRunner,
    check_all_free,
    check_invariants,
    make_request,
    reference_output,
)
from sched_harness import Harness

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.host_block_pool import HostTier
from jaxserve.core.sched.scheduler import Scheduler

# A few shared prefixes so that prefix-cache hits (and evictions) actually happen.
_PREFIXES = [[], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 10]

_request_spec = st.tuples(
    st.sampled_from(range(len(_PREFIXES))),
    st.lists(st.integers(0, 15), min_size=0, max_size=8),  # prompt tail
    st.integers(1, 10),  # max_tokens
    st.integers(-1, 2),  # priority
    st.booleans(),  # with an EOS token
)
_op = st.one_of(
    st.tuples(st.just("add"), st.just(0)),  # add the next pending request
    st.tuples(st.just("fork"), st.integers(0, 50)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 3, 4]),
    num_blocks=st.integers(3, 16),
    budget=st.integers(1, 20),
    max_seqs=st.integers(1, 5),
    max_model_len=st.integers(6, 40),
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    specs=st.lists(_request_spec, min_size=1, max_size=8),
    ops=st.lists(_op, max_size=30),
    host_blocks=st.integers(0, 10),
    mode=st.sampled_from(["recompute", "swap", "auto"]),
    spec_k=st.sampled_from([0, 0, 1, 3]),
    lookahead=st.sampled_from([0, 2]),
    rows_extra=st.sampled_from([0, 3]),
    run_ahead=st.booleans(),
    rng=st.randoms(use_true_random=False),
)
def test_random_workloads_keep_invariants_and_outputs(
    block_size,
    num_blocks,
    budget,
    max_seqs,
    max_model_len,
    caching,
    policy,
    specs,
    ops,
    host_blocks,
    mode,
    spec_k,
    lookahead,
    rows_extra,
    run_ahead,
    rng,
) -> None:
    # "auto" with unit rates swaps a victim when it would copy fewer blocks than it has
    # tokens to recompute: both choices occur. A host tier needs a use (CacheConfig refuses one
    # with neither prefix caching nor swapping).
    if not caching and mode == "recompute":
        host_blocks = 0
    host = HostTier(host_blocks, block_bytes=1, swap_bytes_per_s=1.0) if host_blocks else None
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            policy=policy,
        ),
        CacheConfig(
            block_size=block_size,
            enable_prefix_caching=caching,
            kv_offloading_size=1.0 if host_blocks else 0.0,
            preemption_mode=mode if host_blocks else "recompute",
        ),
        num_blocks,
        host,
        num_speculative_tokens=spec_k,
        num_lookahead_tokens=lookahead,
        max_num_sampling_rows=max_seqs + rows_extra,
    )
    sched.observe_step(1, 1.0)
    runner = FakeRunner(num_blocks, block_size, sched.kv_cache_manager.block_pool)
    # Async scheduling runs ahead only without speculative drafts (EngineCore's rule).
    h = Harness(sched, runner, spec_k, rng, slack=spec_k + lookahead,
                 run_ahead=run_ahead and not spec_k)  # fmt: skip
    pending = list(specs)
    # Unused "add" ops leave requests pending; they all arrive before the final drain.
    for i, op in enumerate(ops + [("add", 0)] * len(specs)):
        if op[0] == "add" and pending:
            prefix, tail, max_tokens, priority, with_eos = pending.pop(0)
            eos = frozenset({3}) if with_eos else frozenset()
            h.add(
                make_request(
                    f"r{i}",
                    _PREFIXES[prefix] + tail,
                    max_tokens,
                    arrival_time=float(i),
                    priority=priority,
                    eos=eos,
                )
            )
        elif op[0] == "fork" and h.reqs:
            parent = list(h.reqs.values())[op[1] % len(h.reqs)]
            child = make_request(
                f"r{i}",
                parent.prompt_token_ids,
                parent.sampling_params.max_tokens,
                arrival_time=float(i),
                eos=parent.eos_token_ids,
            )
            h.add(child, parent.request_id if parent.request_id in sched.requests else None)
        elif op[0] == "abort" and h.reqs:
            rid = list(h.reqs)[op[1] % len(h.reqs)]
            if sched.abort_requests(rid):
                h.aborted.add(rid)
            check_invariants(sched, lookahead=h.slack)
        elif op[0] == "step":
            for _ in range(op[1]):
                h.step()
    for _ in range(3000):
        if not sched.has_unfinished_requests():
            break
        h.step()
    h.drain()
    check_all_free(sched)
    cap = min(max_model_len, (num_blocks - 1) * block_size + 1)
    for rid, req in h.reqs.items():
        expected, reason = reference_output(
            req.prompt_token_ids, req.sampling_params, req.eos_token_ids, cap
        )
        got = req.output_token_ids
        if rid in h.aborted:
            assert got == expected[: len(got)], rid
        else:
            assert got == expected, rid
            assert h.results[rid].finish_reason == reason, rid
            assert h.results[rid].new_token_ids == expected, rid
