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
    VOCAB,
    FakeRunner,
    check_all_free,
    check_invariants,
    make_request,
    merge_output,
    next_token,
    reference_output,
)

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.host_block_pool import HostTier
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.outputs import EngineCoreOutput

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


def _pad_to_4(num_tokens: int) -> int:
    """A step's padded size with token buckets 4, 8, 12, ..."""
    return -(-num_tokens // 4) * 4


class _Harness:
    """Drives the scheduler as EngineCore does. With ``run_ahead`` (async scheduling), each step
    is scheduled and run before the previous one's results are learned: the fake runner
    computes a step when it is scheduled (as a device would, in order), and the scheduler
    learns it one step later."""

    def __init__(
        self,
        sched: Scheduler,
        runner: FakeRunner,
        spec_k: int = 0,
        rng=None,
        slack: int = 0,
        run_ahead: bool = False,
    ) -> None:
        self.sched = sched
        self.runner = runner
        self.results: dict[str, EngineCoreOutput] = {}
        self.reqs: dict = {}
        self.aborted: set[str] = set()
        self.spec_k = spec_k
        self.rng = rng
        self.slack = slack  # slots a table may hold past its computed tokens
        self.run_ahead = run_ahead
        self.in_flight = None  # (SchedulerOutput, ModelRunnerOutput) not yet learned
        self.cap = None  # the next step's max_step_tokens (the policy's "fit" arm), or None

    def step(self) -> None:
        prev = self.in_flight or self._dispatch()
        self.in_flight = self._dispatch() if self.run_ahead else None
        self._learn(prev)
        if self.in_flight is not None and not self.sched.has_unfinished_requests():
            self.drain()

    def drain(self) -> None:
        """Learn the step in flight, if any (every row of it wasted by then, or not)."""
        if self.in_flight is not None:
            prev, self.in_flight = self.in_flight, None
            self._learn(prev)

    def _dispatch(self):
        so = self.sched.schedule()
        num_drafts = sum(map(len, so.scheduled_spec_decode_tokens.values()))
        num_rows = len(so.num_scheduled_tokens) + num_drafts
        assert num_rows <= self.sched.max_num_sampling_rows, "more logits rows than the runner has"
        if self.cap is not None:  # drafts only fill the padding of the step's own bucket
            without = so.total_num_scheduled_tokens - num_drafts
            assert so.total_num_scheduled_tokens <= self.cap(without)
        self.cap = None
        check_invariants(self.sched, lookahead=self.slack)
        return so, self.runner.execute(so)

    def _learn(self, step) -> None:
        for out in self.sched.update_from_output(*step):
            merge_output(self.results, out)
        check_invariants(self.sched, lookahead=self.slack)
        if self.spec_k:
            self.cap = _pad_to_4 if self.rng.random() < 0.5 else None
            self.sched.set_spec_tokens(self._drafts(), self.cap)

    def _drafts(self) -> dict[str, list[int]]:
        """Up to k drafts for each running decode, each the fake model's next token (accepted)
        or a random one (usually rejected), at random."""
        drafts = {}
        for req in self.sched.running:
            if req.num_computed_tokens != req.num_tokens - 1:
                continue
            tokens, guess = list(req.all_token_ids), []
            for _ in range(self.rng.randint(0, self.spec_k)):
                right = next_token(tokens)
                token = right if self.rng.random() < 0.7 else self.rng.randrange(VOCAB)
                guess.append(token)
                tokens.append(token)
            drafts[req.request_id] = guess
        return drafts

    def add(self, req, parent: str | None = None) -> None:
        try:
            self.sched.add_request(req, parent_req_id=parent)
        except ValueError:
            assert req.request_id not in self.sched.requests
            check_invariants(self.sched, lookahead=self.slack)
            return
        self.reqs[req.request_id] = req


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
    h = _Harness(sched, runner, spec_k, rng, slack=spec_k + lookahead,
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
