"""EngineCore: the one path from the engines (LLMEngine, and AsyncLLM through it) to the
scheduler and the runner; one engine step is a three-line recipe (docs/architecture.md).

It knows nothing of tokenizers, text or user request ids: it queues scheduler Requests, steps,
aborts, and recovers from a failed step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from jaxserve.config import EngineConfig
from jaxserve.core.host_block_pool import HostTier
from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.engine.run_ahead import RunAheadPolicy
from jaxserve.engine.runner_protocol import Runner
from jaxserve.outputs import EngineCoreOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.runner.step_trace import ReadyWatch, StepTrace
from jaxserve.spec_decode import SpecDecoder
from jaxserve.structured.constrained_requests import ConstrainedRequests
from jaxserve.structured.step_masks import with_masks_of

if TYPE_CHECKING:
    from jaxserve.engine.background_warmup import BackgroundWarmup


@dataclasses.dataclass
class _Dispatched:
    """A step the runner has started: what was scheduled, the runner's handle, and when (while
    only its forward half runs: that half's handle, and the requests its masks wait for)."""

    so: SchedulerOutput
    dead_ends: dict[str, int]  # constrained request -> its row that no token may continue
    handle: Any
    scheduled_at: float  # perf_counter when its scheduling began
    dispatched_at: float  # ... and when its dispatch began
    trace: StepTrace | None
    forward: Any = None  # the runner's forward handle, until the sample half is dispatched
    masks_for: list[Request] = dataclasses.field(default_factory=list)


class EngineCore:
    """Wires a Scheduler to the runner it is given.

    Args:
        config: the resolved engine config (scheduler and cache settings).
        runner: executes SchedulerOutputs (a ModelRunner).
        num_kv_blocks: pages in the runner's pool, null block included.
        host_tier: the runner's host KV tier, or None.
        run_ahead: with async scheduling, the policy that decides step by step whether to
            run ahead (run_ahead.py: the CPU's plan); None: always.
        warmup: a server's background warm-up (background_warmup.py): each step first runs
            the stage it has compiled, if any, and the scheduler's steps take at most its
            cap's tokens (core/sched/step_cap.py); None: none.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        num_kv_blocks: int,
        host_tier: HostTier | None = None,
        run_ahead: RunAheadPolicy | None = None,
        warmup: BackgroundWarmup | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.num_kv_blocks = num_kv_blocks
        self.host_tier = host_tier
        self.warmup = warmup
        self.scheduler = self._new_scheduler(config)
        # Speculative decoding: proposes each step's drafts (None: off).
        self.spec = None
        if config.speculative is not None:
            # The runner's own proposer (a draft model), or None: the config's; the runner's
            # token buckets give the policy drafts that fit the step's padding.
            buckets = getattr(getattr(runner, "buckets", None), "token_buckets", None)
            self.spec = SpecDecoder(config.speculative, runner.spec_proposer, buckets)
        self._proposal_s = 0.0  # host time of the last proposal (the policy counts it)
        # Async scheduling: the step dispatched and not yet learned, and when the last one
        # was learned.
        self._in_flight: _Dispatched | None = None
        self._learned_at = 0.0
        self.run_ahead_policy = run_ahead
        self._learned_decodes = False  # the last step learned was all one-token decodes
        # The requests with constraints (their masks, drafts and matchers each step): an
        # engine without any pays nothing per step for structured outputs.
        self.constrained = ConstrainedRequests()
        # Whether a step ahead with constrained requests runs its forward half before the
        # step before is learned (its masks built meanwhile); False: it waits for that step,
        # as before the step was split (benchmarks compare the two: bench/structured.py).
        self.overlap_masks = True
        # Called with each step's StepTrace while set (set_step_tracer); None: off.
        self.step_tracer: Callable[[StepTrace], None] | None = None
        self._ready_watch: ReadyWatch | None = None

    @property
    def async_scheduling(self) -> bool:
        """Whether the next step may be scheduled before this one is learned (the config's,
        which the factory resolved from the execution plan's choice when None)."""
        return bool(self.config.scheduler.async_scheduling)

    def set_step_tracer(self, tracer: Callable[[StepTrace], None] | None) -> None:
        """Hand every later step's StepTrace to ``tracer``; None turns tracing off."""
        self.step_tracer = tracer
        if self._ready_watch is not None:
            self._ready_watch.close()
        self._ready_watch = ReadyWatch() if tracer is not None else None

    def step(self) -> list[EngineCoreOutput]:
        """One engine step: schedule, run, learn. With async scheduling (docs/engine_step.md)
        the step it learns is the one before the step it leaves running, when it may run
        ahead (_may_run_ahead); otherwise the next step is dispatched once this one is learned,
        and runs while the caller processes the outputs. A step ahead whose constrained
        requests need the learned tokens for their masks runs its forward half meanwhile; its
        sample half follows the learning (the masks built while the forward runs)."""
        if self.warmup is not None:  # between two steps: a new bucket's first run
            self.warmup.run_ready()
        policy = self.run_ahead_policy
        if not self.async_scheduling or policy is None:
            return self._step(self.async_scheduling)
        outputs = self._step(policy.run_ahead(len(self.scheduler.running)))
        policy.observe(sum(len(o.new_token_ids) for o in outputs), self._learned_decodes)
        return outputs

    def _step(self, run_ahead: bool) -> list[EngineCoreOutput]:
        """step's work: with ``run_ahead``, async scheduling's; else a synchronous step (or,
        when the policy just turned run-ahead off, only the step in flight learned)."""
        if not run_ahead:
            prev, self._in_flight = self._in_flight, None
            return self._finish(prev if prev is not None else self._dispatch())
        prev, self._in_flight = self._in_flight, None
        if prev is None:
            prev = self._dispatch()
        ahead = self._dispatch(masks_later=True) if self._may_run_ahead(prev) else None
        outputs = self._finish(prev)
        if ahead is not None and ahead.forward is not None:
            self._dispatch_sample(ahead)
        self._in_flight = ahead
        if not self.scheduler.has_unfinished_requests():
            self._drain()  # the step in flight, if any, only has rows of finished requests
        elif self._in_flight is None:
            self._in_flight = self._dispatch()
        return outputs

    def _may_run_ahead(self, prev: _Dispatched) -> bool:
        """Whether the next step may be scheduled before ``prev`` is learned: not when a
        speculative proposal needs prev's tokens (the next is dispatched once prev is learned).
        Token masks need them only in the sample half (_dispatch with masks_later), unless
        overlap_masks is off."""
        if self.spec is not None:
            return False
        return self.overlap_masks or (not self.constrained and not prev.so.token_masks)

    def _dispatch(self, masks_later: bool = False) -> _Dispatched:
        """Schedule a step and start it on the runner without waiting for the device; with
        ``masks_later``, a step whose constrained requests sample starts its forward half
        only (_dispatch_sample starts the rest once their masks can be built)."""
        trace = StepTrace() if self.step_tracer is not None else None
        t0 = time.perf_counter()
        so, dead_ends, later = self.constrained.schedule(
            self.scheduler.schedule(), self.scheduler.requests, masks_later
        )
        t1 = time.perf_counter()
        if later:
            forward = self.runner.dispatch_forward(so, trace, [r.request_id for r in later])
            if trace is not None:
                trace.record_phases(t1 - t0, time.perf_counter() - t1)
            return _Dispatched(so, {}, None, t0, t1, trace, forward, later)
        handle = self.runner.dispatch(so, trace)
        t2 = time.perf_counter()
        if trace is not None:
            trace.record_phases(t1 - t0, t2 - t1)
            self._ready_watch.watch(trace, handle, t2)
        return _Dispatched(so, dead_ends, handle, t0, t1, trace)

    def _dispatch_sample(self, step: _Dispatched) -> None:
        """The masks of ``step``'s constrained requests, from their matchers (now past the
        step before's tokens), and its sample half started with them."""
        t0 = time.perf_counter()
        step.so, step.dead_ends = with_masks_of(step.so, step.masks_for)
        t1 = time.perf_counter()
        step.handle = self.runner.dispatch_sample(step.forward, step.so.token_masks)
        step.forward, step.masks_for = None, []
        if step.trace is not None:
            step.trace.masks_s = t1 - t0
            step.trace.execute_s += time.perf_counter() - t1
            self._ready_watch.watch(step.trace, step.handle, t1)

    def _finish(self, step: _Dispatched) -> list[EngineCoreOutput]:
        """Learn a dispatched step: its samples to the host, the scheduler updated (and the
        speculation policy fed, the next drafts proposed)."""
        t0 = time.perf_counter()
        runner_output = self.runner.collect(step.handle)
        t1 = time.perf_counter()
        # The step's device time, about: from its dispatch, or from when the step before it
        # was learned if later, until its samples are here. "auto" preemption turns it into a
        # prefill rate (core/sched/preemption.py).
        seconds = t1 - max(step.dispatched_at, self._learned_at)
        self._learned_at = t1
        self.scheduler.observe_step(step.so.total_num_scheduled_tokens, seconds)
        num_scheduled = step.so.num_scheduled_tokens
        self._learned_decodes = step.so.total_num_scheduled_tokens == len(num_scheduled) > 0
        outputs = self.constrained.update(self.scheduler, step.so, runner_output, step.dead_ends)
        if self.spec is not None:
            self._speculate(outputs, step.scheduled_at, step.so)
        if step.trace is not None:
            step.trace.record_learned(t1 - t0, time.perf_counter() - t1)
            step.trace.ready_event.wait(timeout=60.0)  # the watch notes it as collect returns
            if self.step_tracer is not None:
                self.step_tracer(step.trace)
        return outputs

    def _drain(self) -> None:
        """Learn the step in flight, if any; its outputs are dropped (the engine has no
        unfinished request by then, or is being reset)."""
        prev, self._in_flight = self._in_flight, None
        if prev is not None:
            self._finish(prev)

    def _speculate(
        self, outputs: list[EngineCoreOutput], step_start: float, so: SchedulerOutput
    ) -> None:
        """Feed the step to the speculation policy (tokens emitted, wall time from scheduling
        to this point, plus the previous proposal's time, and what the step scheduled), then
        propose the next step's drafts (the policy decides whether)."""
        spec, sched = self.spec, self.scheduler
        now = time.perf_counter()
        spec.observe_step(sum(len(o.new_token_ids) for o in outputs),
                          now - step_start + self._proposal_s, so.num_scheduled_tokens,
                          so.scheduled_spec_decode_tokens)  # fmt: skip
        # checked against their constraints
        drafts = self.constrained.cut_drafts(
            spec.propose(sched.running), sched.requests, spec.drafts_sampled
        )
        sched.set_spec_tokens(drafts, spec.max_step_tokens)
        self._proposal_s = time.perf_counter() - now

    # ---- requests ---------------------------------------------------------------------------
    def check_prompt_length(self, num_prompt_tokens: int) -> None:
        """Raises ValueError when a prompt of this length cannot run (names the limit)."""
        self.scheduler.check_prompt_length(num_prompt_tokens)

    def add_requests(self, requests: list[Request]) -> None:
        """Queue the samples of one user request, the first one the parent of the others
        (parallel sampling forks its blocks); all or none are queued."""
        added: list[str] = []
        try:
            for i, req in enumerate(requests):
                parent = requests[0].request_id if i else None
                self.scheduler.add_request(req, parent_req_id=parent)
                added.append(req.request_id)
                self.constrained.add(req)
        except BaseException:
            self.scheduler.abort_requests(added)
            raise

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        self.scheduler.abort_requests(list(req_ids))

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(list(req_ids), status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- recovery and resets ----------------------------------------------------------------
    def recover(self) -> list[str]:
        """After a step that raised: abort every request and make the scheduler, the runner
        and the KV pages agree again (pages the step left unusable are reallocated, and the
        prefix cache that described them dropped). Returns the aborted scheduler ids."""
        aborted = self.scheduler.abort_all_requests()
        self._in_flight = None  # its results are not wanted; the runner forgets its requests
        if self.runner.reset():
            self.scheduler.reset_prefix_cache()
        return aborted

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (the KV pages are not touched, only their hashes).

        Returns:
            False, changing nothing, while requests are unfinished (their blocks are in use).
        """
        if self.has_unfinished_requests():
            return False
        return self.scheduler.reset_prefix_cache()

    def reset_scheduler(
        self, *, enable_prefix_caching: bool | None = None, async_scheduling: bool | None = None
    ) -> None:
        """A fresh scheduler (empty pool and prefix cache, zeroed counters), optionally with
        prefix caching or async scheduling switched (then without a run-ahead policy: always
        ahead when on); benchmarks run several workloads on one compiled engine.

        Raises:
            RuntimeError: requests are unfinished, or the runner still holds rows.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("reset_scheduler needs an idle engine")
        self._drain()
        self._finish(self._dispatch())  # hands the last finished ids over: the batch empties
        if not self.runner.is_idle:
            raise RuntimeError("reset_scheduler needs an idle engine: the runner holds requests")
        cache = self.config.cache
        if enable_prefix_caching is not None:
            cache = dataclasses.replace(cache, enable_prefix_caching=enable_prefix_caching)
        scheduler = self.config.scheduler
        if async_scheduling is not None:  # chosen, as in the config: no policy (always)
            scheduler = dataclasses.replace(scheduler, async_scheduling=async_scheduling)
            self.run_ahead_policy = None
        self.config = dataclasses.replace(self.config, cache=cache, scheduler=scheduler)
        self.scheduler = self._new_scheduler(self.config)

    def _new_scheduler(self, config: EngineConfig) -> Scheduler:
        spec = config.speculative
        return Scheduler(
            config.scheduler,
            config.cache,
            self.num_kv_blocks,
            self.host_tier,
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
            # a draft model writes its proposals' KV: k slots past the known tokens
            num_lookahead_tokens=spec.num_speculative_tokens
            if spec is not None and spec.method == "draft_model"
            else 0,
            max_num_sampling_rows=self.runner.max_num_sampling_rows,
            # the KV connector's scheduler half (runner/kv_connector_worker.py), if any
            kv_connector=getattr(getattr(self.runner, "kv_connector", None), "connector", None),
            token_cap=None if self.warmup is None else self.warmup.cap,
        )

    def close(self) -> None:
        """Stop the threads the core and its runner own (the step tracer's ready watch, the
        KV connector's): the engine shuts down. A step in flight is not learned. Idempotent."""
        self._in_flight = None
        self.set_step_tracer(None)
        self.runner.close()

    # ---- introspection ----------------------------------------------------------------------
    def get_stats(self) -> dict[str, Any]:
        """The scheduler's counters, the request counts and the runner's compilations."""
        sched = self.scheduler
        stats: dict[str, Any] = dict(sched.get_stats())
        stats["num_requests_running"] = len(sched.running)
        # requests waiting for KV from another engine wait too (vLLM counts them so)
        stats["num_requests_waiting"] = len(sched.waiting) + len(sched.remote.loading)
        stats["num_compilations"] = self.runner.num_compilations
        stats["num_compilation_cache_hits"] = self.runner.num_compilation_cache_hits
        stats["recompilations"] = self.runner.recompilations
        if self.spec is not None:
            stats.update(self.spec.stats())
        if self.run_ahead_policy is not None:
            stats.update(self.run_ahead_policy.stats())
        return stats
