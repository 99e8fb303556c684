"""The scheduler driven as EngineCore drives it, over the fake runner of sched_fake_model.py:
synchronously, or one step ahead (async scheduling), with random drafts (speculative
decoding) checked against the step's padded size. Shared by the scheduler's property tests."""

from __future__ import annotations

from sched_fake_model import VOCAB, FakeRunner, check_invariants, merge_output, next_token

from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.outputs import EngineCoreOutput


def pad_to_4(num_tokens: int) -> int:
    """A step's padded size with token buckets 4, 8, 12, ..."""
    return -(-num_tokens // 4) * 4


class Harness:
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
            self.cap = pad_to_4 if self.rng.random() < 0.5 else None
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
