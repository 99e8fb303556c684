"""EngineCore: the one path from the engines (LLMEngine, and AsyncLLM through it) to the
scheduler and the runner; one engine step is a three-line recipe (docs/architecture.md).

It knows nothing of tokenizers, text or user request ids: it queues scheduler Requests, steps,
aborts, and recovers from a failed step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from jaxserve.config import EngineConfig
from jaxserve.core.host_block_pool import HostTier
from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.outputs import EngineCoreOutput, ModelRunnerOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.runner.step_trace import StepTrace
from jaxserve.spec_decode import SpecDecoder
from jaxserve.spec_decode.spec_decoder import Proposer
from jaxserve.structured.step_masks import advance_matchers, with_finish_reasons, with_token_masks


class Runner(Protocol):
    def execute_model(
        self, scheduler_output: SchedulerOutput, trace: StepTrace | None = None
    ) -> ModelRunnerOutput:
        """One step; ``trace``, when given, is filled in with the runner's part."""
        ...

    def reset(self) -> bool: ...

    @property
    def max_num_sampling_rows(self) -> int:
        """Logits rows one step can sample (requests plus speculative drafts)."""
        ...

    @property
    def spec_proposer(self) -> Proposer | None:
        """The runner's own speculative proposer (a draft model), or None."""
        ...

    @property
    def is_idle(self) -> bool: ...


class EngineCore:
    """Wires a Scheduler to the runner it is given.

    Args:
        config: the resolved engine config (scheduler and cache settings).
        runner: executes SchedulerOutputs (a ModelRunner).
        num_kv_blocks: pages in the runner's pool, null block included.
        host_tier: the runner's host KV tier, or None.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        num_kv_blocks: int,
        host_tier: HostTier | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.num_kv_blocks = num_kv_blocks
        self.host_tier = host_tier
        self.scheduler = self._new_scheduler(config)
        # Speculative decoding: proposes each step's drafts (None: off).
        self.spec = None
        if config.speculative is not None:
            # The runner's own proposer (a draft model), or None: the config's.
            self.spec = SpecDecoder(config.speculative, proposer=runner.spec_proposer)
        self._proposal_s = 0.0  # host time of the last proposal (the policy counts it)
        self._dead_ends: list[str] = []  # this step's requests that no token may continue
        # Ids of the requests with constraints queued so far, less those gone (pruned each
        # step): an engine without any pays nothing per step for structured outputs.
        self._constrained: set[str] = set()
        # Called with each step's StepTrace while set (set_step_tracer); None: off.
        self.step_tracer: Callable[[StepTrace], None] | None = None

    def set_step_tracer(self, tracer: Callable[[StepTrace], None] | None) -> None:
        """Hand every later step's StepTrace to ``tracer``; None turns tracing off."""
        self.step_tracer = tracer

    def step(self) -> list[EngineCoreOutput]:
        if self.step_tracer is not None:
            return self._traced_step(self.step_tracer)
        step_start = time.perf_counter()
        scheduler_output = self._schedule()
        start = time.perf_counter()
        runner_output = self.runner.execute_model(scheduler_output)
        # The runner returns once the sampled ids are on the host: the step's wall time, which
        # "auto" preemption turns into a prefill rate (core/sched/preemption.py).
        seconds = time.perf_counter() - start
        self.scheduler.observe_step(scheduler_output.total_num_scheduled_tokens, seconds)
        outputs = self._update(scheduler_output, runner_output)
        if self.spec is not None:
            self._speculate(outputs, step_start, scheduler_output)
        return outputs

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
        sched.set_spec_tokens(spec.propose(sched.running))
        self._proposal_s = time.perf_counter() - now

    def _traced_step(self, tracer: Callable[[StepTrace], None]) -> list[EngineCoreOutput]:
        """``step``, timed phase by phase; the runner fills in its part of the trace."""
        trace = StepTrace()
        t0 = time.perf_counter()
        scheduler_output = self._schedule()
        t1 = time.perf_counter()
        runner_output = self.runner.execute_model(scheduler_output, trace)
        t2 = time.perf_counter()
        self.scheduler.observe_step(scheduler_output.total_num_scheduled_tokens, t2 - t1)
        outputs = self._update(scheduler_output, runner_output)
        if self.spec is not None:
            self._speculate(outputs, t0, scheduler_output)
        trace.record_phases(t1 - t0, t2 - t1, time.perf_counter() - t2)
        tracer(trace)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's step, with the token masks of its constrained requests (and their
        dead ends, which _update ends)."""
        so = self.scheduler.schedule()
        self._dead_ends = []
        if self._constrained:
            requests = self.scheduler.requests
            self._constrained.intersection_update(requests)
            so, self._dead_ends = with_token_masks(so, requests, self._constrained)
        return so

    def _update(
        self, so: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """The scheduler learns the step; then constrained requests' matchers advance, and a
        request whose grammar is complete finishes ("stop"), one whose matcher rejected a
        token ends ("abort", logged)."""
        outputs = self.scheduler.update_from_output(so, runner_output)
        if not so.token_masks:
            return outputs
        complete, failed = advance_matchers(outputs, self.scheduler.requests)
        failed = list(dict.fromkeys(failed + self._dead_ends))  # a dead end's EOS: not a stop
        complete = [rid for rid in complete if rid not in failed]
        if complete:
            self.scheduler.finish_requests(complete, RequestStatus.FINISHED_STOPPED)
        if failed:
            self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
        reasons = dict.fromkeys(complete, "stop") | dict.fromkeys(failed, "abort")
        return with_finish_reasons(outputs, reasons)

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
                if req.constraints is not None:
                    self._constrained.add(req.request_id)
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

    def reset_scheduler(self, *, enable_prefix_caching: bool | None = None) -> None:
        """A fresh scheduler (empty pool and prefix cache, zeroed counters), optionally with
        prefix caching switched; benchmarks run several workloads on one compiled engine.

        Raises:
            RuntimeError: requests are unfinished, or the runner still holds rows.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("reset_scheduler needs an idle engine")
        self.step()  # hands the last finished ids to the runner: its batch empties
        if not self.runner.is_idle:
            raise RuntimeError("reset_scheduler needs an idle engine: the runner holds requests")
        cache = self.config.cache
        if enable_prefix_caching is not None:
            cache = dataclasses.replace(cache, enable_prefix_caching=enable_prefix_caching)
        self.config = dataclasses.replace(self.config, cache=cache)
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
        )

    # ---- introspection ----------------------------------------------------------------------
    def get_stats(self) -> dict[str, Any]:
        """The scheduler's counters, the request counts and the runner's compilations."""
        sched = self.scheduler
        stats: dict[str, Any] = dict(sched.get_stats())
        stats["num_requests_running"] = len(sched.running)
        stats["num_requests_waiting"] = len(sched.waiting)
        stats["num_compilations"] = self.runner.num_compilations
        stats["num_compilation_cache_hits"] = self.runner.num_compilation_cache_hits
        stats["recompilations"] = self.runner.recompilations
        if self.spec is not None:
            stats["spec_decode_proposer_seconds"] = self.spec.proposer_seconds
        return stats
